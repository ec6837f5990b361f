"""Speculative decoding: the token tree (`tree`), the lossless acceptance rules (`accept`,
`coupling`), the latency objective and pruning (`objective`, `prune`), the depth predictor
(`predictor`), retrieval (`retrieval`), the methods (`proposers`), the step loop (`engine`), many
sequences at once (`batch`), the step event and its statistics (`metrics`), and the `Decoder`
(`decoder`) that `ygg_runtime.load` returns."""
