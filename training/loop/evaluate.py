"""Held-out loss and passkey retrieval: the Trainer's evaluations, and the scripts'
(training.builders.load_model_for_eval brings a trained model back from its checkpoint)."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from training.parallel.plan import ParallelPlan
from training.process.device import autocast


@torch.no_grad()
def evaluate_loss(model: nn.Module, batches: list, device: torch.device, precision: str,
                  plan: ParallelPlan | None = None) -> float:
    """Mean loss over fixed validation batches (the same batches every call, so values compare);
    a batch (x, y, document_ids) is evaluated with the document mask.

    Under several processes (`plan`, the run's training.parallel.plan.ParallelPlan) data-parallel
    rank r evaluates batches r, r + N, ... and the sums are added over ranks; under context
    parallelism the C ranks of a group each add their share of every batch's mean. Where the plan
    asks every rank to run as many forwards (FSDP2 gathers its weights in each), a short rank
    repeats a batch and discards the result.
    """
    plan = plan or ParallelPlan()
    own, rounds = plan.eval_batches(batches)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for i in range(rounds):
        x, y, *doc_ids = own[i] if i < len(own) else batches[0]   # doc ids: data.document_mask
        with autocast(device, precision):   # the ring is planned from the CPU ids
            loss = plan.eval_loss(model, x.to(device), y.to(device), *doc_ids).float()
        if i < len(own):
            total += loss
    model.train(was_training)
    plan.all_reduce(total)
    return (total / len(batches)).item()


def passkey_ids(tokenizer, length: int, depth: float, key: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of one passkey trial (data/passkey.py builds its text)."""
    from data.passkey import passkey_prompt

    prompt, answer = passkey_prompt(length, depth, key, lambda text: len(tokenizer.encode(text)))
    return tokenizer.encode(prompt), tokenizer.encode(answer)


def shortest_passkey_prompt(tokenizer, key_digits: int = 5) -> int:
    """Tokens of the shortest whole passkey trial, prompt and answer: its filler can shrink to nothing,
    the key sentence and the question cannot. A shorter length cannot be asked."""
    prompt, answer = passkey_ids(tokenizer, 0, 0.0, "9" * key_digits)
    return len(prompt) + len(answer)


def check_probe_lengths(lengths: list[int], tokenizer) -> None:
    """Refuse a `trainer.passkey_probe` length no prompt fits (it would log 0% at every evaluation)."""
    shortest = shortest_passkey_prompt(tokenizer)
    short = [n for n in lengths if n < shortest]
    if short:
        raise ValueError(f"trainer.passkey_probe: {short[0]} is shorter than the shortest passkey prompt "
                         f"({shortest} tokens of this tokenizer)")


@torch.no_grad()
def answer_predictions(model: nn.Module, ids: tuple[list[int], list[int]], device: torch.device,
                       precision: str) -> list[int]:
    """The token the model, teacher-forced, ranks first at each position of the answer: what greedy
    decoding writes while it is right, and where it first goes wrong."""
    prompt_ids, answer_ids = ids
    sequence = torch.tensor([prompt_ids + answer_ids], device=device)
    with autocast(device, precision):
        logits = model(sequence[:, :-1])
    return logits[0, len(prompt_ids) - 1 :].argmax(-1).tolist()


def score_prompt(model: nn.Module, ids: tuple[list[int], list[int]], device: torch.device, precision: str) -> bool:
    """Whether the model, teacher-forced, ranks the right token first at every position of the
    answer: exactly when greedy decoding would write the key."""
    return answer_predictions(model, ids, device, precision) == list(ids[1])


@torch.no_grad()
def passkey_probe(model: nn.Module, tokenizer, lengths: list[int], depths: list[float], trials: int,
                  device: torch.device, precision: str, key_digits: int = 5, seed: int = 0) -> dict[int, float]:
    """Passkey accuracy per prompt length over `depths` x `trials` (the same keys at every call, from
    `seed`, so that values compare along a run): the Trainer's `trainer.passkey_probe`, a small
    slice of scripts/eval_passkey.py's grid logged while the run trains."""
    from data.passkey import random_key

    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    accuracy = {}
    for length in lengths:
        hits = [score_prompt(model, passkey_ids(tokenizer, length, depth, random_key(rng, key_digits)), device,
                             precision) for depth in depths for _ in range(trials)]
        accuracy[length] = sum(hits) / len(hits)
    model.train(was_training)
    return accuracy
