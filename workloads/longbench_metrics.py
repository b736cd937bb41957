"""LongBench v1 scoring, exactly as the official `metrics.py` / `eval.py` (THUDM/LongBench, `LongBench/`
subfolder: post-processing, metrics and aggregation).

All 21 datasets and the 13 LongBench-E files. The quirks are deliberate and published numbers depend on them:
ROUGE-L comes from the `rouge` package (case-sensitive, sentence split on ".", unique-word sets, any exception
scores 0), both-empty QA F1 scores 0, dureader/vcsum are segmented with jieba but not normalised, the retrieval
and count scores count every digit run of the prediction, classification drops matched class names contained in
the reference with the official loop's skip-after-removal, and code similarity is `fuzzywuzzy`'s `fuzz.ratio` on
the first line free of "`", "#" and "//". `rouge`, `jieba`, `fuzzywuzzy` and numpy are imported lazily, and torch
never: `scoutbench score` runs without it.
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

# The registry: LongBench v1's 21 datasets (dataset2maxlen.json order) and the 13 with a LongBench-E file.
DATASETS = ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
            "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
            "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p")
E_DATASETS = tuple(f"{name}_e" for name in ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report",
                                             "multi_news", "trec", "triviaqa", "samsum", "passage_count",
                                             "passage_retrieval_en", "lcc", "repobench-p"))
# Datasets whose prediction is cut to its first line before scoring.
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# LongBench-E buckets by the record's `length` field (words for English, characters for Chinese; not tokens).
E_BUCKETS = ("0-4k", "4-8k", "8k+")

_PUNCTUATION = frozenset(string.punctuation)  # ASCII only: curly quotes and dashes survive normalisation
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGIT_RUN = re.compile(r"\d+")  # Python's \d, as the official code (Unicode decimal digits included)
_PARAGRAPH_ID = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ID_ZH = re.compile(r"段落(\d+)")
# LongBench's Chinese normalisation removes ASCII punctuation plus these (the official string, in its order).
_ZH_PUNCTUATION = frozenset(string.punctuation + "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】"
                                                 "〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_CODE_COMMENT_MARKS = ("`", "#", "//")


def check_dataset(name: str, also: tuple[str, ...] = ()) -> str:
    """`name` if it is a LongBench v1 dataset or a LongBench-E file, else a usage error listing them and `also`
    (the other names the caller accepts, e.g. 'all' and the passkey tasks for `accuracy`)."""
    if name not in DATASETS and name not in E_DATASETS:
        from scoutbench.errors import UsageError

        others = f"; also: {', '.join(also)}" if also else ""
        raise UsageError(f"unknown dataset {name!r}; LongBench v1: {', '.join(DATASETS)}; "
                         f"LongBench-E: {', '.join(E_DATASETS)}{others}")
    return name


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


def normalize_zh_answer(text: str) -> str:
    """Lowercase, drop ASCII and the listed CJK punctuation, delete all whitespace (LongBench's zh normalisation)."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCTUATION).split())


def qa_f1_zh_score(prediction: str, reference: str) -> float:
    """jieba precise-mode tokens, each normalised, empty ones dropped, then multiset F1 (multifieldqa_zh)."""
    import jieba

    jieba.setLogLevel(60)

    def tokens(text: str) -> list[str]:
        return [word for word in (normalize_zh_answer(token) for token in jieba.cut(text, cut_all=False)) if word]

    return token_f1(tokens(prediction), tokens(reference))


def rouge_zh_score(prediction: str, reference: str) -> float:
    """jieba precise-mode segmentation joined by spaces, then rouge_score; no Chinese normalisation."""
    return rouge_score(_jieba_words(prediction), _jieba_words(reference))


def _digit_run_share(prediction: str, target: str) -> float:
    """Fraction of the prediction's digit runs equal to `target` (textually); no digits scores 0."""
    numbers = _DIGIT_RUN.findall(prediction)
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def _retrieval(pattern: re.Pattern[str], label: str, prediction: str, reference: str) -> float:
    targets = pattern.findall(reference)
    if not targets:  # the official code crashes here too; say why
        raise ValueError(f"retrieval reference {reference!r} has no '{label}N'")
    return _digit_run_share(prediction, targets[0])


def retrieval_score(prediction: str, reference: str) -> float:
    """Share of the prediction's digit runs equal to the reference's "Paragraph N" number (passage_retrieval_en)."""
    return _retrieval(_PARAGRAPH_ID, "Paragraph ", prediction, reference)


def retrieval_zh_score(prediction: str, reference: str) -> float:
    """The same with the reference's "段落N" (passage_retrieval_zh)."""
    return _retrieval(_PARAGRAPH_ID_ZH, "段落", prediction, reference)


def count_score(prediction: str, reference: str) -> float:
    """Share of the prediction's digit runs equal to the reference count (passage_count)."""
    return _digit_run_share(prediction, str(reference))


def code_sim_score(prediction: str, reference: str) -> float:
    """`fuzz.ratio` / 100 of the reference and the prediction's first line (after leading newlines) without "`",
    "#" or "//" ("" when every line has one), through `fuzzywuzzy` itself, as the official code (lcc, repobench-p).
    fuzzywuzzy uses python-Levenshtein when installed and difflib otherwise, as in the official environment; the
    installed versions are recorded with every result (`env.scoring`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Using slow pure-python SequenceMatcher": the official setup has it too
        from fuzzywuzzy import fuzz

    candidate = ""
    for line in prediction.lstrip("\n").split("\n"):
        if not any(mark in line for mark in _CODE_COMMENT_MARKS):
            candidate = line
            break
    return fuzz.ratio(candidate, reference) / 100


def classification_score(prediction: str, reference: str, all_classes: list[str]) -> float:
    """1 / (number of class names found in the prediction) when the reference is among them, else 0 (trec, lsht).

    Found names contained in the reference (but not equal to it) are dropped with the official loop, which removes
    from the list it iterates over and so never looks at the name right after a removed one; the score depends on
    that, so it is kept."""
    matches = [name for name in all_classes if name in prediction]
    for name in matches:  # deliberately mutated while iterated (the official behaviour)
        if name in reference and name != reference:
            matches.remove(name)
    return 1.0 / len(matches) if reference in matches else 0.0


DATASET_METRIC: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
METRIC_NAMES = {"qa_f1_score": "qa_f1", "qa_f1_zh_score": "qa_f1_zh", "rouge_score": "rouge_l",
                "rouge_zh_score": "rouge_l_zh", "retrieval_score": "retrieval", "retrieval_zh_score": "retrieval_zh",
                "count_score": "count", "code_sim_score": "code_sim", "classification_score": "classification"}


def base_dataset(name: str) -> str:
    """`qasper_e` -> `qasper`: the LongBench-E files use their base dataset's template, metric and rules."""
    return name.removesuffix("_e")


def metric_name(dataset: str) -> str:
    return METRIC_NAMES[DATASET_METRIC[base_dataset(dataset)].__name__]


def postprocess(dataset: str, prediction: str) -> str:
    """First line (after leading newlines) for trec, triviaqa, samsum and lsht; every other prediction is raw."""
    if base_dataset(dataset) in FIRST_LINE_DATASETS:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def example_score(dataset: str, prediction: str, answers: Iterable[str],
                  all_classes: list[str] | None = None) -> float:
    """The best score over all references (max, never the mean), on the post-processed prediction; 0-1."""
    metric = DATASET_METRIC[base_dataset(dataset)]
    if metric is classification_score:
        if not all_classes:
            raise ValueError(f"{dataset}: classification needs the records' all_classes (null here)")
        metric = functools.partial(classification_score, all_classes=all_classes)
    prediction = postprocess(dataset, prediction)
    score = 0.0
    for reference in answers:
        score = max(score, metric(prediction, reference))
    return score


def _file_classes(rows: list[dict[str, Any]]) -> list[str] | None:
    """eval.py scores every line with the `all_classes` of the file's last line (it keeps overwriting one variable)."""
    return rows[-1].get("all_classes")


def dataset_score(dataset: str, rows: list[dict[str, Any]]) -> float:
    """LongBench score: sum of example scores in file order / n, x100, Python round to 2 decimals."""
    if not rows:
        raise ValueError(f"{dataset}: no predictions to score")
    classes = _file_classes(rows)
    total = 0.0
    for row in rows:
        total += example_score(dataset, row["pred"], row["answers"], classes)
    return round(100 * total / len(rows), 2)


def bucket_of(length: int) -> str:
    return E_BUCKETS[0] if length < 4000 else E_BUCKETS[1] if length < 8000 else E_BUCKETS[2]


def dataset_score_e(dataset: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    """LongBench-E: per length bucket, round(100 * numpy mean, 2) (numpy's rounding); an empty bucket is NaN, as
    numpy's mean of nothing in the official code."""
    import numpy as np

    if not rows:
        raise ValueError(f"{dataset}: no predictions to score")
    classes = _file_classes(rows)
    buckets: dict[str, list[float]] = {name: [] for name in E_BUCKETS}
    for row in rows:
        buckets[bucket_of(row["length"])].append(example_score(dataset, row["pred"], row["answers"], classes))
    return {name: float(round(100 * np.mean(scores), 2)) if scores else math.nan
            for name, scores in buckets.items()}
