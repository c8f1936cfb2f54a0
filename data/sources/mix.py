"""`data=stdlib-passkey`: a corpus with synthetic documents mixed in (the corpus's longest documents
and passkey prompts for long-context training, configs/experiment/long-context-passkey.yaml).

The mix holds the corpus's documents, then the synthetic ones; training windows are drawn from all
of them (the synthetic documents' share of the tokens is their share of the windows). Two things
stay the corpus's alone, so that runs mixing in other synthetic documents (another passkey length,
another count) remain comparable on the same held-out text:

- the tokenizer: a BPE trains on the corpus's documents and is keyed by the corpus's fingerprint
  (`tokenizer_corpus`), so such runs share one vocabulary and their losses per token compare;
- the validation split: only corpus documents are held out, chosen as for the corpus on its own
  (`train_only_keys` names the synthetic ones, data/stream.py's split leaves them out), so the
  validation loss and `scripts/eval_loss_by_position.py` read corpus text only, the same text for
  every such run.
"""
from __future__ import annotations

import numpy as np

from data.digest import name_key


class MixSource:
    def __init__(self, corpus, synthetic):
        self.corpus, self.synthetic = corpus, synthetic
        self.name = f"{corpus.name}-{synthetic.name}"
        self.fingerprint = f"{corpus.fingerprint}+{synthetic.fingerprint}"
        counts = (corpus.num_documents, synthetic.num_documents)
        self.num_documents = None if None in counts else sum(counts)

    def for_tokenizer(self, tokenizer) -> "MixSource":
        return MixSource(self.corpus.for_tokenizer(tokenizer), self.synthetic.for_tokenizer(tokenizer))

    def documents(self):
        """The corpus's documents, then the synthetic ones; dense-retrieval documents (exactly one window
        each, data/retrieval.py) come first instead, so that under data.windows=fixed every one of
        them is a whole window (the corpus after them is cut into windows as it falls)."""
        parts = (self.corpus, self.synthetic)
        if getattr(self.synthetic, "kind", None) == "dense":
            parts = parts[::-1]
        for part in parts:
            yield from part.documents()

    def tokenizer_corpus(self):
        """The source a BPE trains on and is keyed by: the corpus alone."""
        return self.corpus

    def train_only_keys(self) -> np.ndarray:
        """Name keys (data.digest.name_key) of the documents never held out: the synthetic ones."""
        return np.array([name_key(name) for name in self.synthetic.names()], dtype=np.uint64)
