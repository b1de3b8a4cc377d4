"""Evaluation: the retrieval protocol and its metrics (:mod:`.metrics`), validation and test epochs
(:mod:`.validation`), re-ranking by the matching head (:mod:`.rerank`), zero-shot classification (:mod:`.zeroshot`)."""
