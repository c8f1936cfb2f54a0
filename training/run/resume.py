"""The resume planner: what `resume=` means for a run folder. Which checkpoint to trust (asking the
checkpoint store, training.run.store), which run the folder holds, which differences from the
checkpoint's config are accepted, and, once the data and model are built, the checkpoint put
back (`restore`).

One run per `run.dir`. A run has an id (its lineage), recorded in every checkpoint it writes
and in `run.dir/lineage.jsonl`, one row per start (fresh, resumed, rewound or branched, with the
config changes it accepted). Pruning and `resume=auto` look only at that run's checkpoints:
another run's file dropped into the folder is never deleted, never counted as kept, never
resumed from.

- `resume=null` (fresh): refused where the folder already holds a run (checkpoints,
  `metrics.jsonl` rows, `model.safetensors`).
- `resume=auto`: the newest usable checkpoint of the folder's run. None at all (the run stopped
  before its first save): start over from step 0, its `metrics.jsonl` rows moved to
  `superseded/<time>/`. Unusable ones only, or final weights without checkpoints: refuse
  (starting over would replace what they are evidence of).
- `resume=continue`: as `auto`, but a folder without a checkpoint of its run is refused rather than
  started from step 0: for a command that only makes sense as a continuation (a second stage's
  preset, `experiment=long-context-retrieval-long`), whose settings alone would train a run nobody
  designed.
- `resume=<file>`: a checkpoint of the folder's own run rewinds it: its checkpoints past that
  step, their metrics rows and the final `model.safetensors` are moved to `superseded/<time>/`
  (nothing is deleted). A checkpoint of another run starts a branch: allowed only into a folder
  that holds no run yet; the branch gets its own id and records where it came from.

The start decided here is written down by training.run.lineage once the run is accepted
(lineage.jsonl, and what a rewind sets aside, journaled so that a start killed half-way is
finished by the next one).

Continuing a run (auto, or a rewind) compares the training config (`trainer`, `optim`, `data`)
with the checkpoint's: a difference that changes the numbers the run computes is refused in one
line listing the keys unless named in `allow_changes=[key, group, ...]`; accepted changes go
into lineage.jsonl. A branch may change them (that is what a branch is for): they are recorded
and logged. Keys that change only how the run is observed or executed (`FREE_ON_RESUME`) may
always change; those no run can continue under another value of (`CHECKED_ELSEWHERE`: the seed,
the sequence length, ...) are refused by the check that reads them. A branch may change the
sequence length, to extend (or cut) a run's context from its checkpoint: its data position carries
over as the same fraction of its epoch, as it does onto changed data.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from training.run.files import LINEAGE, METRICS, WEIGHTS
from training.run.lineage import Start, new_run_id, recorded_run_id
from training.run.metrics import MetricsFile
from training.run.store import (ANY_RUN, CheckpointError, CheckpointStore, Restore, describe_differences,
                                is_checkpoint_folder, lineage_id, load_checkpoint, step_of)

log = logging.getLogger(__name__)
CONTINUING = ("auto", "continue")   # the resume= words that continue the run folder's own run

TRAINING_GROUPS = ("trainer", "optim", "data")
# Keys outside the `model` group that change what the model computes: a resume must keep them.
COMPUTE_KEYS = ("data.document_mask", "attention.window")
# Keys that change how a run is observed, stored or executed, not the numbers it computes.
FREE_ON_RESUME = {
    "trainer": ("progress", "log_every", "eval_every", "eval_batches", "ckpt_every", "keep_ckpts", "compile",
                "peak_flops", "dist_timeout_s", "parallel", "context_parallel", "deterministic", "cpu_threads", "passkey_probe", "passkey_trials"),
    "optim": ("fused",),
    "data": ("cache_dir", "verify_cache", "allow_changed"),
}
# Keys a run can never continue under another value of, each refused by the check that knows what
# it means (old checkpoints included), so not compared here and not open to allow_changes.
CHECKED_ELSEWHERE = {"seed": "the data sampler", "trainer.seq_len": "the data sampler",
                     "data.windows": "the data sampler", "optim.decay_embeddings": "the optimizer's parameter groups",
                     "data.document_mask": "the model"}


def checkpoint_to_load(source: Path) -> tuple[Path, dict]:
    """(path, state) of a checkpoint (a file or a DCP folder), or of a run folder's newest usable checkpoint written by
    the run its lineage.jsonl names (any run's in a folder without one): what the scripts that
    read a trained run (evals, export) take as their argument."""
    if not source.is_dir() or is_checkpoint_folder(source):   # a file, or one FSDP run's DCP folder
        return source, load_checkpoint(source)
    found = CheckpointStore(source).latest(recorded_run_id(source) or ANY_RUN)
    if found is None:
        raise ValueError(f"{source} holds no usable checkpoint under checkpoints/")
    return found


def metric_steps(run_dir: str | Path) -> list[int]:
    path = Path(run_dir) / METRICS
    return [r["step"] for r in MetricsFile.read(path)] if path.is_file() else []


def run_evidence(store: CheckpointStore) -> str:
    """What in the store's run folder shows a run was there ('' for none): checkpoints, metric rows, weights."""
    found, run_dir = [], store.run_dir
    if store.list():
        found.append("checkpoints/")
    steps = metric_steps(run_dir)
    if steps:
        found.append(f"{METRICS} up to step {max(steps)}")
    if (Path(run_dir) / WEIGHTS).exists():
        found.append(WEIGHTS)
    return ", ".join(found)


def _folder_run(run_dir: Path, usable: dict[Path, str | None]) -> str | None:
    """The folder's own run: the one lineage.jsonl names, else the one run its checkpoints are of
    (None for a folder from before lineages were recorded, or an empty one)."""
    recorded = recorded_run_id(run_dir)
    if recorded is not None:
        return recorded
    runs = set(usable.values())
    if len(runs) > 1:
        names = ", ".join(sorted(f"{p.name} (run {r or 'unrecorded'})" for p, r in usable.items()))
        raise CheckpointError(f"run.dir={run_dir} holds checkpoints of {len(runs)} runs and no {LINEAGE} saying "
                              f"which is its own ({names}): pass resume=<one of them>, or move the others out")
    return next(iter(runs), None)


def _refuse_foreign_in_the_way(store: CheckpointStore, usable: dict, run_id: str | None, start: int,
                               max_steps: int) -> None:
    """Warn about other runs' checkpoints; refuse when this run would write over one of them."""
    foreign = {p: r for p, r in usable.items() if r != run_id}
    for path, other in foreign.items():
        log.warning("%s belongs to another run (%s): kept, not counted, not resumed from", path, other or "unrecorded")
    in_the_way = [p for p in foreign if start < step_of(p) <= max_steps]
    if in_the_way:
        raise CheckpointError(f"run.dir={store.run_dir}: {in_the_way[0]} belongs to another run "
                              f"({foreign[in_the_way[0]] or 'unrecorded'}) and this run would write over it at step "
                              f"{step_of(in_the_way[0])}: move it out of {store.folder}")


def plan_start(cfg: DictConfig, store: CheckpointStore) -> Start:
    """The run's start in the store's run folder from `cfg.resume`; CheckpointError / ValueError (one
    line) when the folder or the checkpoint does not allow it. Reads only: nothing is written here."""
    run_dir, resume, max_steps = store.run_dir, cfg.get("resume"), int(cfg.trainer.max_steps)
    check_allow_changes(cfg)
    for read in (metric_steps, recorded_run_id):   # a hand-edited row of either file: one line now, before any work
        read(run_dir)
    if resume is None:
        if store.list():
            raise ValueError(f"run.dir={run_dir} already holds checkpoints: pass resume=auto to continue "
                             f"that run, or choose another run.dir")
        evidence = run_evidence(store)
        if evidence:
            raise ValueError(f"run.dir={run_dir} already holds a run ({evidence}): pass resume=auto to continue it, "
                             f"or choose another run.dir")
        return Start(new_run_id(), "start")
    if resume not in CONTINUING and Path(resume).is_dir() and not is_checkpoint_folder(resume):
        raise CheckpointError(f"resume={resume} is a folder: pass a checkpoint (<run.dir>/checkpoints/"
                              f"step_XXXXXXXX.pt or .dcp), or run.dir={resume} resume=auto to continue that run")
    usable, unusable = store.lineages()
    own = _folder_run(run_dir, usable)
    if resume in CONTINUING:
        start = _plan_auto(store, usable, unusable, own, resume)
    else:
        start = _plan_path(store, Path(resume), usable, own)
    if start.state is not None and start.event != "branch":
        _refuse_foreign_in_the_way(store, usable, own, start.step, max_steps)
    if start.state is not None:  # what the model computes first, then how it is trained
        saved = start.state["config"]
        check_model_config(start.checkpoint, saved.get("model", {}), OmegaConf.to_container(cfg.model))
        check_unchanged(start.checkpoint, saved, cfg, COMPUTE_KEYS)
        start.changes = accepted_changes(start, cfg, run_dir)
    return start


def _plan_auto(store: CheckpointStore, usable: dict, unusable: list, own: str | None, mode: str) -> Start:
    """resume=auto or resume=continue (`mode`): the newest usable checkpoint of the folder's run; with
    none, auto starts over from step 0 where that loses nothing, continue never does."""
    run_dir, ckpt_dir = store.run_dir, store.folder
    mine = [p for p, r in usable.items() if r == own]
    for path in reversed(mine):  # newest first; one that fails its checksum is skipped
        try:
            state = load_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping %s", e)
            unusable.append(path)
            continue
        # own is None for a run from before lineages were recorded: it goes on as that unrecorded run.
        return Start(own, "resume", path, state, (state.get("lineage") or {}).get("parent"))
    if unusable:
        raise CheckpointError(f"resume={mode}: none of the {len(unusable)} checkpoint(s) in {ckpt_dir} is "
                              f"usable (see the warnings above); move them aside to start over from step 0")
    if usable:
        raise CheckpointError(f"resume={mode}: every checkpoint in {ckpt_dir} belongs to another run than "
                              f"run.dir={run_dir}'s own ({own or 'unrecorded'}): move them out, or branch from one "
                              f"with resume=<its path> into an empty run.dir")
    if (run_dir / WEIGHTS).exists():   # a finished run whose checkpoints were removed
        raise CheckpointError(f"resume={mode}: run.dir={run_dir} holds {run_evidence(store)} but no checkpoint: "
                              f"starting over would replace them; move them aside (or choose another run.dir) to "
                              f"start from step 0")
    if mode == "continue":
        raise CheckpointError(f"resume=continue: run.dir={run_dir} holds no checkpoint to continue: pass "
                              f"resume=<the earlier stage's checkpoint> to branch from it into this run.dir, or "
                              f"run that stage here first (resume=auto starts from step 0 with these settings)")
    steps = metric_steps(run_dir)
    if steps:   # stopped before its first checkpoint: nothing to continue from, nothing lost by starting over
        log.warning("resume=auto: no checkpoint in %s (the run stopped before its first was saved): starting over "
                    "from step 0", ckpt_dir)
    else:
        log.info("resume=auto: no checkpoint in %s, starting from step 0", ckpt_dir)
    return Start(own or new_run_id(), "restart" if own or steps else "start", sets_aside=bool(steps))


def _plan_path(store: CheckpointStore, path: Path, usable: dict, own: str | None) -> Start:
    run_dir, state = store.run_dir, load_checkpoint(path)
    source = lineage_id(state)
    evidence = run_evidence(store)
    in_own_folder = path.resolve().parent == store.folder.resolve()
    if not evidence:
        parent = {"id": source, "step": int(state["step"]), "checkpoint": str(path.resolve())}
        return Start(new_run_id(), "branch", path, state, parent)
    if (source is not None and source == own) or (source is None and own is None and in_own_folder):
        later = [p for p, r in usable.items() if r == own and step_of(p) > int(state["step"])]
        return Start(own, "rewind" if later else "resume", path, state,
                     (state.get("lineage") or {}).get("parent"), superseded=later, sets_aside=bool(later))
    raise CheckpointError(f"resume={path}: that checkpoint belongs to run {source or 'unrecorded'}, but run.dir="
                          f"{run_dir} holds run {own or 'unrecorded'} ({evidence}): one folder holds one run; "
                          f"branch into an empty run.dir, or continue this one with resume=auto")


# ----------------------------------------------------------------------------- training config

def check_allow_changes(cfg: DictConfig) -> None:
    for entry in cfg.get("allow_changes") or []:
        if entry in CHECKED_ELSEWHERE:
            raise ValueError(f"allow_changes: {entry} cannot change within a run ({CHECKED_ELSEWHERE[entry]} depends "
                             f"on it): start a new run.dir")
        if str(entry).split(".")[0] not in TRAINING_GROUPS:
            raise ValueError(f"allow_changes: {entry!r} is not a training setting (expected trainer, optim, data or "
                             f"one of their keys, e.g. trainer.max_steps)")


def training_differences(saved_cfg: dict, cfg: DictConfig) -> dict[str, list]:
    """{"group.key": [checkpoint's value, this run's]} over the training groups, leaving out
    FREE_ON_RESUME and CHECKED_ELSEWHERE. A key the checkpoint's config lacks (added since) is not
    compared: what runs before it did is the concern of the check that reads it (the data
    sampler's state, the optimizer's parameter groups), not the schema's default."""
    diffs = {}
    for group in TRAINING_GROUPS:
        old, new = saved_cfg.get(group, {}), OmegaConf.to_container(cfg[group], resolve=True)
        for key in sorted(set(old) & set(new)):
            name = f"{group}.{key}"
            if key not in FREE_ON_RESUME.get(group, ()) and name not in CHECKED_ELSEWHERE and old[key] != new[key]:
                diffs[name] = [old[key], new[key]]
    return diffs


def _allowed(key: str, allow: list[str]) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in allow)


def accepted_changes(start: Start, cfg: DictConfig, run_dir: Path) -> dict[str, list]:
    """The differences from the checkpoint's training config this start accepts; CheckpointError
    listing the others. A branch accepts them all (logged)."""
    diffs = training_differences(start.state["config"], cfg)
    if start.event == "branch":
        saved_len = start.state["config"].get("trainer", {}).get("seq_len")
        if saved_len is not None and saved_len != cfg.trainer.seq_len:   # context extension: restore() maps the data position
            diffs["trainer.seq_len"] = [saved_len, cfg.trainer.seq_len]
        if diffs:
            log.warning("branch from %s with other training settings: %s", start.checkpoint, _describe(diffs))
        return diffs
    allow = [str(a) for a in cfg.get("allow_changes") or []]
    if cfg.data.get("allow_changed"):
        allow.append("data")  # continuing on other data: the data keys say which
    refused = {k: v for k, v in diffs.items() if not _allowed(k, allow)}
    if refused:
        allow_them = (f"pass allow_changes=[{','.join(refused)}] to continue with the new values (recorded in "
                      f"{run_dir / LINEAGE})")
        preset = left_out_preset(start.state["config"], cfg, refused)
        advice = (f"the run was made with experiment={preset}, which this command leaves out: add "
                  f"experiment={preset} (as the run's `resume with:` line does), or {allow_them}" if preset
                  else f"{allow_them}, or the checkpoint's values")
        raise CheckpointError(f"checkpoint {start.checkpoint} was trained with other training settings: "
                              f"{_describe(refused)}; {advice}")
    if diffs:
        log.warning("continuing with changed training settings (allow_changes): %s", _describe(diffs))
    return diffs


def left_out_preset(saved_cfg: dict, cfg: DictConfig, refused: dict[str, list]) -> str | None:
    """The preset (configs/experiment/) the checkpoint's run was made with, when this command left
    it out: the one its run.name names (each preset names its runs after itself), when this run's
    name differs and the preset sets the refused keys it sets to the checkpoint's values."""
    from training.config import CONFIG_DIR
    from training.run.records import flatten

    name = (saved_cfg.get("run") or {}).get("name")
    path = CONFIG_DIR / "experiment" / f"{name}.yaml"
    if not name or name == cfg.run.get("name") or not path.is_file():
        return None
    preset = flatten(OmegaConf.to_container(OmegaConf.load(path)))
    set_there = [key for key in refused if key in preset]
    return name if set_there and all(preset[key] == refused[key][0] for key in set_there) else None


def _describe(diffs: dict) -> str:
    return "; ".join(f"{k}={old!r} in checkpoint, {new!r} now" for k, (old, new) in diffs.items())


# ----------------------------------------------------------------------------- what a resume checks

# Model keys that do not change the function or the weights (exact memory features).
_MODEL_KEYS_FREE_TO_CHANGE = ("activation_checkpointing", "loss_chunk_size", "block_chunk_size",
                              "offload_activations")


def check_unchanged(path: str | Path, saved_cfg: dict, cfg, keys: tuple[str, ...]) -> None:
    """Refuse a resume that changes what the model computes outside the `model` group: the
    "group.key" names in `keys` (`data.document_mask`, `attention.window`), each at the schema's
    default where an older checkpoint or config lacks it."""
    from omegaconf import OmegaConf

    from training.config.schema import default_of

    diffs = []
    for key in keys:
        group, name = key.split(".")
        default = default_of(key)
        old = saved_cfg.get(group, {}).get(name, default)
        new = OmegaConf.select(cfg, key, default=default)
        if old != new:
            diffs.append(f"{key}={old!r} in checkpoint, {new!r} now")
    if diffs:
        raise CheckpointError(f"checkpoint {path} was trained with {'; '.join(diffs)}: it changes what the model "
                              f"computes (pass the checkpoint's values, or start a new run.dir)")


def check_model_config(path: str | Path, saved: dict, current: dict) -> None:
    """Refuse weights trained with another model config, even one with the same tensor shapes
    (heads, norm, RoPE base, tied embeddings): they would load into a different function.
    A key added to the schema since the checkpoint was written counts at its default."""
    from training.config.checks import check_group

    saved, current = check_group("model", saved), check_group("model", current)
    ignore = set(_MODEL_KEYS_FREE_TO_CHANGE)
    if saved.get("pos_emb", "rope") == current.get("pos_emb") == "rope":
        ignore.add("max_seq_len")  # RoPE has no table: the longest length is a limit, not a weight
    diff = describe_differences({k: v for k, v in saved.items() if k not in ignore},
                                        {k: v for k, v in current.items() if k not in ignore})
    if diff:
        raise CheckpointError(f"checkpoint {path} was trained with another model config: {diff} "
                              f"(pass the checkpoint's values, or start a new run.dir)")


# ----------------------------------------------------------------------------- putting it back

def _sampler_state_carried(saved: dict, sampler, other_length: bool) -> dict:
    """The saved position carried over to a changed corpus, and with `other_length` (a branch's) to
    windows of the sampler's length: same epoch, same fraction of it. Without it a saved length other
    than the sampler's stays, for the sampler to refuse."""
    length = sampler.seq_len if other_length else int(saved["seq_len"])
    if int(saved["n_windows"]) == sampler.n_windows and int(saved["seq_len"]) == length:
        return saved
    in_epoch = len(sampler.order(int(saved["epoch"])))   # this epoch's windows on the new data
    cursor = int(saved["cursor"]) * in_epoch // max(1, int(saved["n_windows"]))
    return {**saved, "n_windows": sampler.n_windows, "seq_len": length,
            "cursor": min(cursor, in_epoch - sampler.world_size)}


def _tokenizer_of(data_fingerprint: str | None) -> str | None:
    """The tokenizer's part of a data fingerprint, `<source>/<tokenizer>/v<cache version>` (data/build.py)."""
    parts = (data_fingerprint or "").rsplit("/", 2)
    return parts[1] if len(parts) == 3 else None


def _content(tokenizer_fingerprint: str | None) -> str | None:
    """What identifies a tokenizer's vocabulary: its file's hash (`<name><size>-<sha256[:10]>`), so
    the same file under another option (tokenizer=pretrained tokenizer.path=...) is the same one."""
    return tokenizer_fingerprint.rsplit("-", 1)[-1] if tokenizer_fingerprint else tokenizer_fingerprint


def check_tokenizer(start: Start, tokenizer_fingerprint: str | None) -> None:
    """Refuse to continue the start's checkpoint with another tokenizer: its token ids would mean
    other text, whatever `data.allow_changed` says. The trainer asks as soon as the tokenizer is
    built (data.build.build_data's check_tokenizer), before the corpus is tokenized with it."""
    if start.state is None:
        return
    saved_tok = _tokenizer_of(start.state["config"].get("run", {}).get("data_fingerprint"))
    if saved_tok is not None and _content(saved_tok) != _content(tokenizer_fingerprint):
        raise CheckpointError(f"checkpoint {start.checkpoint} was trained with tokenizer {saved_tok}, this run's is "
                              f"{tokenizer_fingerprint}: its token ids would mean other text (data.allow_changed "
                              f"does not cover it); resume with the checkpoint's tokenizer settings")


def restore(start: Start, *, model, sampler, data_fingerprint: str, cfg: DictConfig) -> tuple[Restore, dict | None]:
    """The start's checkpoint put back into the plain model (its weights), the sampler and the RNGs,
    the rest held for once the parallel plan has wrapped the model (`Restore.finish`); with the data
    change to record (data_changes.jsonl, written once the run is accepted), or None. Nothing to put
    back for a fresh start.

    Refuses another model config and a checkpoint of other data (the sampler position would index
    different tokens) unless `data.allow_changed`, which continues at the same point of the epoch on
    the new data; a branch in windows of another length continues at that point too. Another
    tokenizer was refused as soon as it was built, before the corpus was tokenized with it
    (`check_tokenizer`).
    """
    if start.state is None:
        return Restore(), None
    path, state, model_cfg = start.checkpoint, start.state, OmegaConf.to_container(cfg.model)
    check_model_config(path, state["config"].get("model", {}), model_cfg)
    saved_fp = state["config"].get("run", {}).get("data_fingerprint")
    sampler_state, change = state["sampler"], None
    # a branch that extends (or cuts) the context: its position carries over; a continuation's is refused
    other_length = start.event == "branch" and int(sampler_state["seq_len"]) != sampler.seq_len
    if other_length:
        log.warning("branch from %s in windows of %d tokens, not the checkpoint's %d: the data position carries over "
                    "as the same fraction of its epoch", path, sampler.seq_len, int(sampler_state["seq_len"]))
    if saved_fp != data_fingerprint:
        if not cfg.data.get("allow_changed", False):
            raise CheckpointError(f"checkpoint {path} was trained on data {saved_fp}, this run reads "
                                  f"{data_fingerprint}: the corpus changed; pass data.allow_changed=true to continue on the new data")
        log.warning("data changed since %s: %s -> %s; continuing (data.allow_changed=true)", path, saved_fp,
                    data_fingerprint)
        change = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": state["step"],
                  "checkpoint": str(path), "from": saved_fp, "to": data_fingerprint}
    if change or other_length:
        sampler_state = _sampler_state_carried(sampler_state, sampler, other_length)
    restored = Restore(path, state)
    restored.into_model(model, model_cfg, sampler, sampler_state)
    start.state = None   # the tensors are in the model now (or held by `restored`); the start's step stays
    return restored, change
