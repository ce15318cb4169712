"""Calibration data: strings, token ids, chat records or a local file -> ``[n_samples, seq_len]`` token ids."""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Sequence, Union

import torch

from ..errors import DeltaZipError

CalibrationLike = Union[str, os.PathLike, Sequence, torch.Tensor, None]

logger = logging.getLogger(__name__)


def calibration_length(model, seq_len: int) -> int:
    """``seq_len``, or the model's context length when that is shorter (with a warning).

    A model with learned positions (GPT-2, OPT) has no position beyond its context and fails on longer
    sequences; for the others they are positions the model never saw in training.
    """
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and 0 < context < seq_len:
        logger.warning(
            "calibration sequences of seq_len=%d tokens are longer than the model's context of %d positions: "
            "using %d-token sequences (set DeltaZipConfig(seq_len=%d) to silence this)", seq_len, context, context, context,
        )
        return context
    return seq_len


def _records_from_file(path: Path) -> list:
    if path.suffix == ".jsonl":
        records = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DeltaZipError(f"{path}, line {lineno}: not valid JSON ({e.msg}); one JSON object per line") from None
        return records
    if path.suffix in (".txt", ".md", ".py", ".text"):
        return [path.read_text(encoding="utf-8", errors="replace")]
    raise DeltaZipError(f"{path}: calibration files must be .jsonl (one record per line) or .txt")


def _record_text(record, tokenizer) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, list) and record and isinstance(record[0], dict) and "role" in record[0]:
        record = {"messages": record}
    if isinstance(record, dict):
        if "messages" in record:
            if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
                return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in record["messages"])
            return tokenizer.apply_chat_template(record["messages"], tokenize=False)
        if "text" in record:
            return str(record["text"])
        if "prompt" in record:
            return str(record["prompt"]) + str(record.get("completion", record.get("response", "")))
    raise DeltaZipError(
        f"cannot read calibration record {str(record)[:80]!r}: use strings, {{'text': ...}}, "
        "{'messages': [...]} or {'prompt': ..., 'completion': ...}"
    )


def prepare_calibration(
    calibration: CalibrationLike,
    tokenizer=None,
    *,
    n_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
) -> torch.Tensor:
    """Turn calibration input into a ``[n, L]`` LongTensor of token ids (``n <= n_samples``, ``L <= seq_len``).

    Args:
        calibration: a list of strings or chat records, a ``[B, L]`` or 1-D tensor of token ids, a list
            of id lists, or the path of a local ``.jsonl`` / ``.txt`` file.
        tokenizer: needed for text; chat records use its chat template.
        n_samples: sequences wanted.
        seq_len: tokens per sequence.
        seed: which windows are sampled from the token stream.

    Returns:
        LongTensor ``[n, L]``: windows of the concatenated token stream (documents separated by EOS).
    """
    if calibration is None:
        raise DeltaZipError("no calibration data: pass texts, token ids or a .jsonl/.txt file")
    if isinstance(calibration, torch.Tensor):
        if calibration.dtype.is_floating_point or calibration.dtype.is_complex or calibration.dtype == torch.bool:
            raise DeltaZipError(f"calibration token ids must be an integer tensor, got {calibration.dtype} "
                                "(a float tensor would be truncated to ids): pass input_ids")
        ids = calibration.long()
        if ids.dim() == 2:
            if ids.numel() == 0:
                raise DeltaZipError(f"calibration data has no tokens (token ids of shape {tuple(ids.shape)})")
            return ids[:n_samples, :seq_len].contiguous()
        if ids.dim() != 1:
            raise DeltaZipError(f"calibration token ids must be 1-D or [batch, seq], got shape {tuple(ids.shape)}")
        stream = ids.tolist()
    else:
        if isinstance(calibration, (str, os.PathLike)):
            path = Path(calibration)
            if not path.is_file():
                raise DeltaZipError(f"calibration file {path} not found")
            records = _records_from_file(path)
        else:
            records = list(calibration)
        if not records:
            raise DeltaZipError("calibration data is empty")
        if all(isinstance(r, (list, tuple)) and r and isinstance(r[0], int) for r in records):
            docs = [list(r) for r in records]
        elif all(isinstance(r, torch.Tensor) for r in records):
            docs = [r.reshape(-1).tolist() for r in records]
        else:
            if tokenizer is None:
                raise DeltaZipError("calibration texts need a tokenizer: pass tokenizer= (deltazip compress --tokenizer), or give token ids")
            texts = [_record_text(r, tokenizer) for r in records]
            docs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        stream = []
        for d in docs:
            stream.extend(d)
            if eos is not None:
                stream.append(eos)
    if not stream:
        raise DeltaZipError("calibration data has no tokens")
    if len(stream) <= seq_len:
        return torch.tensor([stream], dtype=torch.long)
    starts = list(range(0, len(stream) - seq_len + 1, seq_len))
    rng = random.Random(seed)
    if len(starts) > n_samples:
        starts = sorted(rng.sample(starts, n_samples))
    return torch.tensor([stream[s : s + seq_len] for s in starts], dtype=torch.long)
