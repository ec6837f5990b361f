"""A lighter drafter: its output head cut to the tokens it is likely to need (`--draft-vocab N|all|auto`).

The drafter only proposes, so its head may cover part of the vocabulary: a token it has no row for
is simply never drafted (greedy output is unchanged), and when sampling its q is the cut head's
softmax, 0 elsewhere (`proposers.Drafter.fit`; the lossless rules need nothing more). On a CPU the
head of a 0.5B drafter with a 152k vocabulary is a quarter of its multiply-adds and of the bytes a
forward streams, while a generation uses a few thousand distinct tokens (FR-Spec, arXiv
2502.14856, cut an EAGLE drafter's head by 75 % at about no acceptance loss).

Which rows: the tokenizer's special tokens (end of turn and of text must stay draftable), then
tokens by their count in the calibration texts (prompts and the target's greedy continuations),
then by token id — in byte-pair tokenizers ids follow merge order, so lower ids are the more
frequent pieces (measured on the default pair: the 32k lowest ids cover 94 % of the target's
output tokens on Spec-Bench, a Python-source frequency list only 90 %).

How many: `auto` measures, for each candidate size, the acceptance it keeps and what it costs.
Acceptance is cross-validated on the calibration texts (rows ranked on half of the prompts,
agreement measured on the other half, and the reverse): along the target's own continuation the
drafter's greedy token, among the head's rows only, is compared with the target's, and a chain of
k = 4 is replayed on the agreements (tokens per target forward). The cost: the target's compiled
forwards at 1 and k + 1 rows are timed, and a drafter forward of one row, bound by the bytes it
streams like the target's, costs the target's time per byte for its body and its head's rows. The
size with the best modelled chain speed-up wins.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from ygg_compile.latency import forward_times
from ygg_compile.roofline import model_costs
from ygg_runtime.errors import YggError
from ygg_runtime.decoding import engine, proposers
from ygg_runtime.model.transformer import ModelArgs, load_model
from ygg_runtime.model.quant import pack, unpack
from ygg_runtime.model.runner import ModelRunner

if TYPE_CHECKING:
    from ygg_compile.calibrate import Calibration
    from ygg_runtime.schema.plan import ModelInfo
    from ygg_runtime.text import TextCodec
    from ygg_runtime.ui import Reporter

CANDIDATES = (4096, 8192, 16384, 32768, 65536)  # head rows tried by `auto` (besides the whole vocabulary)
SMALL_VOCAB = 16384  # a vocabulary this small keeps its whole head (the head is cheap already)
CHAIN_K = 4  # the chain the acceptance is replayed on


def parse(value: str) -> int | None:
    """--draft-vocab: "auto" (None), "all" (0) or a number of rows."""
    if value == "auto":
        return None
    if value == "all":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise YggError(f"--draft-vocab takes a number of tokens, all or auto, not {value!r}") from None
    if n < 1:
        raise YggError(f"--draft-vocab must be at least 1, not {n}")
    return n


def ranking(texts: list[list[int]], special: list[int], vocab: int) -> list[int]:
    """Every token id below `vocab`, most wanted first: special tokens, then by count in `texts`
    (ties by id), then by id."""
    counts = Counter(t for text in texts for t in text if t < vocab)
    first = [t for t in dict.fromkeys(special) if 0 <= t < vocab]
    seen = set(first)
    ranked = first + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in seen]
    seen.update(ranked)
    return ranked + [t for t in range(vocab) if t not in seen]


def chain_tokens_per_forward(agree: list[bool], ends: list[int], k: int = CHAIN_K) -> float:
    """Tokens per target forward of a greedy chain of k drafted tokens replayed along texts whose
    positions agree (the drafter's token is the target's) as `agree` says; `ends` are the texts'
    boundaries in `agree` (a chain stops at its text's end)."""
    tokens = forwards = 0
    start = 0
    for end in ends:
        pos = start
        while pos < end:
            run = 0
            while run < k and pos + run < end and agree[pos + run]:
                run += 1
            step = min(run + 1, end - pos)
            tokens, forwards, pos = tokens + step, forwards + 1, pos + step
        start = end
    return tokens / max(1, forwards)


@dataclass
class Choice:
    """What `auto` measured and chose (the plan's `planning.draft_vocab`)."""

    rows: int  # the head's rows (the vocabulary: not cut)
    vocab: int
    why: str
    table: list[dict] = field(default_factory=list)  # per candidate: rows, tokens per forward, draft ms, speed-up
    ids: Tensor | None = None  # the kept token ids, ascending (None: the whole vocabulary)


def _greedy_within(draft_logits: Tensor, order: Tensor, sizes: list[int]) -> Tensor:
    """[len(sizes), n]: for each head size, the drafter's greedy token when only the first `size`
    tokens of `order` have rows (computed where the logits are, returned on the host)."""
    order = order.to(draft_logits.device)
    out = []
    for size in sizes:
        keep = order[:size]
        out.append(keep[draft_logits[:, keep].argmax(-1)])
    return torch.stack(out).cpu()


def choose(target: ModelRunner, draft: ModelRunner, texts: dict[int, list[int]], starts: dict[int, int],
           special: list[int], asked: int | None) -> Choice:
    """The drafter's head rows: `asked` when given (0: all), else measured (see the module)."""
    vocab = draft.model.args.vocab_size
    if asked == 0 or (asked is None and vocab <= SMALL_VOCAB):
        why = "--draft-vocab all" if asked == 0 else f"a {vocab}-token vocabulary is small: whole head kept"
        return Choice(vocab, vocab, why)
    if asked is not None:
        rows = min(asked, vocab)
        order = ranking(list(texts.values()), special, vocab)
        return Choice(rows, vocab, f"--draft-vocab {asked}", ids=torch.tensor(sorted(order[:rows])) if rows < vocab else None)
    sizes = [n for n in CANDIDATES if n < vocab] + [vocab]
    # the drafter's logits and the target's tokens along every text, teacher-forced
    prompts = sorted(texts)
    halves = [prompts[0::2], prompts[1::2]]
    agree = {n: [] for n in sizes}
    ends: list[int] = []
    for h, held_out in enumerate(halves):
        ranked_on = [texts[p] for p in halves[1 - h]]
        order = torch.tensor(ranking(ranked_on, special, vocab))
        for p in held_out:
            seq, start = texts[p], starts[p]
            d = _teacher_forced(draft, [t if t < vocab else 0 for t in seq])[start - 1 : len(seq) - 1]
            want = torch.tensor(seq[start:])
            picks = _greedy_within(d, order, sizes)
            for i, n in enumerate(sizes):
                agree[n] += (picks[i] == want).tolist()
            ends.append((ends[-1] if ends else 0) + len(want))
    draft.reset()
    # costs: the target's (compiled) forwards at 1 and k + 1 rows are timed; a forward of one row
    # streams its weights (memory-bound), so the drafter's costs what its bytes cost the target
    # (the drafter is compiled only once its head is cut: timing it eager would add Python's time)
    times = forward_times(target, (1, CHAIN_K + 1), context=64, repeats=7)
    verify_ms, plain_ms = times[CHAIN_K + 1], times[1]
    per_byte = plain_ms / model_costs(target.model).weight_bytes
    body = model_costs(draft.model).weight_bytes - _head_bytes(draft)
    table = []
    for n in sizes:
        tpf = chain_tokens_per_forward(agree[n], ends)
        d_ms = per_byte * (body + _head_bytes(draft) * n / vocab)
        speedup = tpf * plain_ms / (CHAIN_K * d_ms + verify_ms)
        table.append({"rows": n, "tokens_per_forward": round(tpf, 3), "top1_agreement": round(sum(agree[n]) / max(1, len(agree[n])), 4),
                      "draft_ms": round(d_ms, 2), "chain_speedup": round(speedup, 3)})
    best = max(table, key=lambda r: (r["chain_speedup"], r["rows"]))
    rows = best["rows"]
    order = ranking(list(texts.values()), special, vocab)  # the kept rows: ranked on every text
    why = (f"measured: chain k={CHAIN_K} {best['tokens_per_forward']} tokens/forward at {rows} rows vs "
           f"{table[-1]['tokens_per_forward']} with all {vocab}; drafter {best['draft_ms']} vs {table[-1]['draft_ms']} ms")
    return Choice(rows, vocab, why, table, torch.tensor(sorted(order[:rows])) if rows < vocab else None)


def _teacher_forced(runner: ModelRunner, seq: list[int], chunk: int = 64) -> Tensor:
    runner.reset()
    out = []
    for i in range(0, len(seq), chunk):
        part = seq[i : i + chunk]
        out.append(runner.forward_chain(part).float())
        runner.commit(list(range(len(part))))
    runner.reset()
    return torch.cat(out)


def _head_bytes(runner: ModelRunner) -> int:
    head = runner.model.output
    return sum(t.numel() * t.element_size() for t in [*head.parameters(), *head.buffers()])


def cut_head(args: ModelArgs, state: dict[str, Tensor], ids: Tensor) -> tuple[ModelArgs, dict[str, Tensor]]:
    """The converted drafter with its head cut to the rows of `ids` (ascending token ids): a
    quantized head is unpacked and packed again with those rows; a float one (or the embedding
    table it is tied to) sliced. `head_ids` maps the rows back to token ids."""
    state = dict(state)
    if "output.data" in state:
        (codes,) = unpack({"data": state["output.data"], "layout": state["output.layout"]})
        state.update({f"output.{k}": v for k, v in pack(codes.rows(ids)).items()})
    else:
        weight = state.get("output.weight", state.get("tok_embeddings.weight"))
        state["output.weight"] = weight[ids].clone()
    state["head_ids"] = ids.clone()
    return replace(args, head_rows=len(ids), tie_embeddings=False), state


def cut_drafter_head(runners: dict, models: dict[str, ModelInfo], codec: TextCodec, texts_in: list[str], tokens: int,
                     special: list[int], draft_vocab: str, tmp: Path, phase, ui: Reporter,
                     stored: Calibration | None = None) -> dict:
    """The drafter's head cut to the rows `--draft-vocab` asks for or `auto` measures
    (`choose`), on the target's greedy continuations of the calibration prompts
    (a stored calibration's own, when given); the drafter is rewritten and reloaded in place.
    Returns the plan's record of the choice."""
    asked = parse(draft_vocab)
    draft = runners["draft"]
    texts, starts = {}, {}
    if stored is not None:
        texts, starts = stored.texts, stored.prompt_lengths
    elif asked is None and draft.model.args.vocab_size > SMALL_VOCAB:
        with phase("draft vocab", f"decoding {len(texts_in)} calibration prompts with the target for the drafter's vocabulary"):
            ar = proposers.build("ar", {}, None)
            for i, text in enumerate(texts_in):
                ids = codec.encode(text)
                if len(ids) + tokens + 1 > runners["target"].max_len:
                    continue
                out, _ = engine.generate(runners["target"], ar, ids, max_new_tokens=tokens)
                texts[i], starts[i] = ids + out, len(ids)
    with phase("draft vocab", "measuring the drafter's head cut to the tokens it needs"):
        choice = choose(runners["target"], draft, texts, starts, special, asked)
        if choice.ids is not None:
            args = ModelArgs.load(tmp / "draft" / "config.json")
            state = load_file(str(tmp / "draft" / "model.safetensors"))
            head_bytes = lambda s: sum(v.numel() * v.element_size() for k, v in s.items() if k.startswith("output."))  # noqa: E731
            before = head_bytes(state)
            args, state = cut_head(args, state, choice.ids)
            after = head_bytes(state)
            save_file(state, str(tmp / "draft" / "model.safetensors"))
            args.save(tmp / "draft" / "config.json")
            del state
            if models["draft"].weights.kind != "float":
                models["draft"].weights.bytes += after - before
            runners["draft"] = ModelRunner(load_model(tmp / "draft", draft.device, invariant=False), draft.max_len)
            ui.note(f"drafter head: {choice.rows} of {choice.vocab} tokens ({choice.why})")
    return {"rows": choice.rows, "vocab": choice.vocab, "why": choice.why, "candidates": choice.table}
