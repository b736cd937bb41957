"""LongBench v1 scoring, exactly as the official `metrics.py` / `eval.py` (THUDM/LongBench, spec: longbench.md §6-§8).

Only the metrics our eight datasets use. The quirks are deliberate and published numbers depend on them:
ROUGE-L comes from the `rouge` package (case-sensitive, sentence split on ".", unique-word sets, any exception
scores 0), both-empty QA F1 scores 0, dureader is segmented with jieba but not normalised, and the retrieval score
counts every digit run of the prediction. `rouge`, `jieba` and numpy are imported lazily: `import scoutbench`
never needs them.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

# Datasets whose prediction is cut to its first line before scoring (of our eight: samsum only).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# LongBench-E buckets by the record's `length` field (words for English, characters for Chinese; not tokens).
E_BUCKETS = ("0-4k", "4-8k", "8k+")

_PUNCTUATION = frozenset(string.punctuation)  # ASCII only: curly quotes and dashes survive normalisation
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGIT_RUN = re.compile(r"\d+")  # Python's \d, as the official code (Unicode decimal digits included)
_PARAGRAPH_ID = re.compile(r"Paragraph (\d+)")


def normalize_answer(text: str) -> str:
    """Lowercase, drop ASCII punctuation, replace the articles a/an/the by a space, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction_tokens: list[str], reference_tokens: list[str]) -> float:
    """Multiset-overlap F1; no overlap (including both sides empty) is 0."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, reference: str) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def rouge_score(prediction: str, reference: str) -> float:
    """ROUGE-L F of the `rouge` package; any exception (empty text, its recursion limit on long sentences) is 0.

    The package backtracks its LCS recursively, so a ~1000-word period-less sentence overflows Python's recursion
    limit and scores 0, as in the official eval. Where exactly that happens depends on the caller's stack depth
    (here a few frames deeper than eval.py); outputs within the official max_new_tokens never get close.
    """
    from rouge import Rouge

    try:
        return Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"]
    except Exception:  # the official code swallows every error here, and the score depends on that
        return 0.0


def _jieba_words(text: str) -> str:
    import jieba

    jieba.setLogLevel(60)  # silence the "Building prefix dict" banner; segmentation is unchanged
    return " ".join(jieba.cut(text, cut_all=False))


def rouge_zh_score(prediction: str, reference: str) -> float:
    """jieba precise-mode segmentation joined by spaces, then rouge_score; no Chinese normalisation."""
    return rouge_score(_jieba_words(prediction), _jieba_words(reference))


def retrieval_score(prediction: str, reference: str) -> float:
    """Fraction of the prediction's digit runs that equal the reference's paragraph number (textually)."""
    targets = _PARAGRAPH_ID.findall(reference)
    if not targets:  # the official code crashes here too; say why
        raise ValueError(f"passage_retrieval reference {reference!r} has no 'Paragraph N'")
    target = targets[0]
    numbers = _DIGIT_RUN.findall(prediction)
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


DATASET_METRIC: dict[str, Callable[[str, str], float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "samsum": rouge_score,
    "passage_retrieval_en": retrieval_score,
}
METRIC_NAMES = {"qa_f1_score": "qa_f1", "rouge_score": "rouge_l", "rouge_zh_score": "rouge_l_zh",
                "retrieval_score": "retrieval"}


def base_dataset(name: str) -> str:
    """`qasper_e` -> `qasper`: the LongBench-E files use their base dataset's template, metric and rules."""
    return name.removesuffix("_e")


def metric_name(dataset: str) -> str:
    return METRIC_NAMES[DATASET_METRIC[base_dataset(dataset)].__name__]


def postprocess(dataset: str, prediction: str) -> str:
    """First line (after leading newlines) for samsum-like datasets; every other prediction is scored raw."""
    if base_dataset(dataset) in FIRST_LINE_DATASETS:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def example_score(dataset: str, prediction: str, answers: Iterable[str]) -> float:
    """The best score over all references (max, never the mean), on the post-processed prediction; 0-1."""
    metric = DATASET_METRIC[base_dataset(dataset)]
    prediction = postprocess(dataset, prediction)
    score = 0.0
    for reference in answers:
        score = max(score, metric(prediction, reference))
    return score


def dataset_score(dataset: str, rows: list[dict[str, Any]]) -> float:
    """LongBench score: sum of example scores in file order / n, x100, Python round to 2 decimals."""
    if not rows:
        raise ValueError(f"{dataset}: no predictions to score")
    total = 0.0
    for row in rows:
        total += example_score(dataset, row["pred"], row["answers"])
    return round(100 * total / len(rows), 2)


def bucket_of(length: int) -> str:
    return E_BUCKETS[0] if length < 4000 else E_BUCKETS[1] if length < 8000 else E_BUCKETS[2]


def dataset_score_e(dataset: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    """LongBench-E: per length bucket, round(100 * numpy mean, 2) (numpy's rounding); an empty bucket is NaN."""
    import numpy as np

    buckets: dict[str, list[float]] = {name: [] for name in E_BUCKETS}
    for row in rows:
        buckets[bucket_of(row["length"])].append(example_score(dataset, row["pred"], row["answers"]))
    return {name: float(round(100 * np.mean(scores), 2)) if scores else math.nan
            for name, scores in buckets.items()}
