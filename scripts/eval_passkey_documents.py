"""Does a passkey-trained model copy its keys, or remember them? Retrieval on its own training documents.

    python scripts/eval_passkey_documents.py runs/retrieval --lengths 2048 8192 --docs 20
    python scripts/eval_passkey_documents.py runs/retrieval --lengths 2048 --fresh-lengths 2000 3000

scripts/eval_passkey.py asks in the eval's prompt form (data/passkey.py); a run trained on
dense-retrieval documents (data.passkey.kind=dense, data/retrieval.py) can answer its own documents
and still miss those prompts. This tool scores, teacher-forced as eval_passkey does, the question of
documents of the run's own settings, at each length:

- seen: the first `--docs` documents of that length in the run's data (its data.passkey, seed and all),
  trained on once the run has gone through its passkey units;
- fresh: as many documents built the same way from another seed, keys the model never saw.

Seen right and fresh wrong: the model remembers its training keys (it cycled through them for
epochs) rather than copies them. Both right and the eval's grid wrong: what fails is the prompt's
form or place, not the copy. `--fresh-lengths` adds fresh documents of lengths the run never trained
at (with data.passkey.ask_last its questions end documents of a few lengths only, so a copy tied to
the answer's position from the document's start would fail there). Each document is scored on its
last question, read back from its text. Writes <out>/passkey_documents_<name>.{json,md}.
"""
from __future__ import annotations

import re

import _common  # noqa: F401  (puts the repo root on sys.path)
import numpy as np

from _common import environment, markdown_table, print_table, require_positive, run_cli, write_json, write_text
from _eval import add_checkpoint_args, load_for_eval, run_name
from data.passkey import QUESTION_FORM
from training.loop.evaluate import answer_predictions

# a question of data/passkey.py's form and its answer: " What is the bako key? The bako key is 12345."
QUESTION = re.compile(" " + re.escape(QUESTION_FORM).replace(re.escape("{name}"), r"(\w+)", 1)
                      .replace(re.escape("{name}"), r"\1") + r"(?= (\d+)\.)")


def question_ids(text: str, tokenizer) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a document's last question: the text up to "... key is", the key
    after a space (the eval's split of a prompt from its answer)."""
    asked = list(QUESTION.finditer(" " + text))
    if not asked:
        raise ValueError("a passkey document without a question: data.passkey.kind must be dense")
    last = asked[-1]
    return tokenizer.encode(text[: last.end() - 1]), tokenizer.encode(" " + last.group(2))


def seen_documents(source, lengths: set[int], docs: int) -> dict[int, list[str]]:
    """The first `docs` documents of each wanted length (in tokens, end-of-text included) of the run's
    passkey source, in its training order; stops once every length has them."""
    lengths_of = {name: length for name, length, _ in source.layout()}
    found: dict[int, list[str]] = {n: [] for n in lengths}
    for name, text in source.documents():
        bucket = found.get(lengths_of[name])
        if bucket is not None and len(bucket) < docs:
            bucket.append(text)
        if all(len(b) == docs for b in found.values()):
            break
    return found


def fresh_documents(source, length: int, docs: int, seed: int) -> list[str]:
    """`docs` documents of `length` tokens built as the run's source builds them (as many keys as its
    documents of that length have, else data.passkey.pairs), from another seed."""
    from data.retrieval import dense_document

    keys = next((k for _, n, k in source.layout() if n == length), source.pairs)
    rng = np.random.default_rng(seed)
    return [dense_document(length, keys, source.key_digits, rng, source.count_tokens, source.ask_last)[0]
            for _ in range(docs)]


def score(model, texts: list[str], tokenizer, device, precision: str) -> tuple[float, list[str]]:
    """(share answered right at every key token, the first few wrong answers as 'key -> said')."""
    right, wrong = 0, []
    for text in texts:
        ids = question_ids(text, tokenizer)
        said = answer_predictions(model, ids, device, precision)
        if said == list(ids[1]):
            right += 1
        elif len(wrong) < 3:
            wrong.append(f"{tokenizer.decode(ids[1]).strip()} -> {tokenizer.decode(said)!r}")
    return right / len(texts), wrong


def main(argv: list[str]) -> None:
    parser = _common.argument_parser(__doc__)
    add_checkpoint_args(parser)
    parser.add_argument("--lengths", type=int, nargs="+", required=True,
                        help="document lengths in tokens, each one the run trained at (seen and fresh)")
    parser.add_argument("--fresh-lengths", type=int, nargs="*", default=[],
                        help="lengths of fresh documents only (any the layout fits)")
    parser.add_argument("--docs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=2**31 - 1, help="the fresh documents' seed")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default=None)
    args = parser.parse_args(argv)
    require_positive(args, "lengths", "docs")

    from data.sources.passkey import PasskeySource

    model, cfg, tokenizer, device, path = load_for_eval(args)
    passkey = cfg.data.get("passkey") if cfg.data.name == "stdlib-passkey" else cfg.data
    if cfg.data.name not in ("passkey", "stdlib-passkey") or passkey.get("kind") != "dense":
        raise ValueError(f"{path}: trained on data={cfg.data.name} without dense passkey documents; "
                         "this tool reads the questions of data.passkey.kind=dense")
    source = PasskeySource.from_config(passkey).for_tokenizer(tokenizer)
    if source.seed == args.seed:
        raise ValueError(f"--seed {args.seed} is the run's own data.passkey.seed: the fresh documents would be the seen")
    trained = {length for _, length, _ in source.layout()}
    if missing := sorted(set(args.lengths) - trained):
        raise ValueError(f"--lengths {missing[0]}: the run has no document of that length "
                         f"(it trained on {', '.join(f'{n:,}' for n in sorted(trained))})")
    precision = args.precision or cfg.trainer.precision
    # every document first: a length that holds none is refused before any forward
    documents = {n: {"seen": texts} for n, texts in seen_documents(source, set(args.lengths), args.docs).items()}
    for length in args.lengths + args.fresh_lengths:
        try:
            fresh = fresh_documents(source, length, args.docs, args.seed + length)
        except ValueError as exc:
            flag = "--lengths" if length in trained else "--fresh-lengths"
            raise ValueError(f"{flag} {length}: {str(exc).split(': ', 1)[-1]}") from None
        documents.setdefault(length, {})["fresh"] = fresh
    rows = []
    for length in args.lengths + args.fresh_lengths:
        row = {"length": length, "trained_at": length in trained}
        for group, texts in documents[length].items():
            row[group], row[f"{group}_wrong"] = score(model, texts, tokenizer, device, precision)
            row[f"{group}_docs"] = len(texts)
        rows.append(row)
        print(row, flush=True)
    name = run_name(args, path)
    result = {"name": name, "checkpoint": str(path), "docs": args.docs, "seed": args.seed, "precision": precision,
              "ask_last": source.ask_last, "tokenizer": tokenizer.fingerprint, "rows": rows,
              "environment": environment(device)}
    headers = ["length", "trained at", "seen", "fresh", "fresh's wrong answers"]
    table = [(f"{r['length']:,}", "yes" if r["trained_at"] else "no", f"{r['seen']:.2f}" if "seen" in r else "-",
              f"{r['fresh']:.2f}", "; ".join(r["fresh_wrong"]) or "-") for r in rows]
    print_table(f"retrieval on its own documents: {name}", headers, table)
    stem = args.out_dir / f"passkey_documents_{name}"
    write_json(stem.with_suffix(".json"), result)
    write_text(stem.with_suffix(".md"), f"# Retrieval on its own training documents: {name}\n\n"
               f"{args.docs} documents a length, teacher-forced, {precision}; fresh: seed {args.seed} + the length; "
               f"data.passkey.ask_last={source.ask_last}.\n\n" + markdown_table(headers, table))
    print(f"wrote {stem}.{{json,md}}")


if __name__ == "__main__":
    run_cli(main)
