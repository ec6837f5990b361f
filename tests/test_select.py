"""The exact choices over a vocabulary-wide row (`ygg_runtime.decoding.select`) against torch's own."""

import torch

from ygg_runtime.decoding.select import first_max, top_k


def awkward_rows(v: int, g: torch.Generator) -> torch.Tensor:
    """Random rows and the cases a blocked search could get wrong: every token tied, a maximum
    tied across blocks, half the row -inf, NaN, a row of -inf, many ties inside blocks."""
    rows = torch.randn(9, v, generator=g)
    rows[1, :] = 0.0
    rows[2, [v // 3, v - 1]] = 50.0
    rows[3, v // 2 :] = float("-inf")
    rows[4, v // 2] = float("nan")
    rows[5, :] = float("-inf")
    rows[6, [v - 1, v // 7]] = float("nan")
    rows[7, :] = rows[7, :].round()
    rows[8, ::2] = float("-inf")
    return rows


WIDTHS = (151936, 65536, 4096, 300, 257, 1)  # Qwen's vocabulary, a cut head, and widths no block count divides


def test_the_targets_choice_is_torch_argmax_bit_for_bit_with_ties_nan_and_rows_of_minus_infinity():
    g = torch.Generator().manual_seed(0)
    for v in WIDTHS:
        rows = awkward_rows(v, g)
        assert torch.equal(first_max(rows), rows.argmax(-1)), v
        assert torch.equal(first_max(rows[2:5]), rows[2:5].argmax(-1))  # a slice of rows, as a tree's
        assert torch.equal(first_max(rows.double()), rows.double().argmax(-1))


def test_the_drafters_top_children_are_torch_topk_values_and_tokens():
    """The k largest values, largest first, exactly; the tokens too where no two values tie (with
    ties, tokens carrying those values)."""
    g = torch.Generator().manual_seed(1)
    for v in WIDTHS:
        for k in (1, 2, 8, 40):
            rows = torch.randn(6, v, generator=g)
            rows[1, v // 2 :] = float("-inf")
            rows[2, :] = rows[2, :].round()  # ties
            values, tokens = top_k(rows, k)
            ref = rows.topk(min(k, v))
            assert torch.equal(values, ref.values), (v, k)
            assert torch.equal(rows.gather(1, tokens), values)
            assert all(len(set(r.tolist())) == len(r) for r in tokens)  # k distinct tokens a row
            distinct = [0, 1, 3, 4, 5]
            assert torch.equal(tokens[distinct], ref.indices[distinct]), (v, k)
