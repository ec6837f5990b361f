"""One model and how it runs: the gpt-fast-style decoder (`transformer`) and its quantized weights
(`quant`), the static slot-addressed KV cache (`kv`), a forward's inputs and CUDA graphs (`graphs`),
the ahead-of-time compiled forward (`compiled`) and the runner a decoding step calls (`runner`).
Its ops are the backend's (`ygg_runtime.backend`)."""
