"""OpenVINO GenAI's generation, in a process of its own under the OpenVINO venv's Python
(`make install-openvino` builds .venv-openvino: optimum-intel needs a transformers ours is not).

Run by path, not as a module: it imports the standard library and OpenVINO only, nothing of ours
(whose dependencies that venv does not hold). `ygg_bench.peer_process` starts it with one end of a
socket pair and speaks `multiprocessing.connection`'s pickled messages over it:

    ("load", {"target": IR dir, "draft": IR dir | None, "gguf": GGUF file | None, "threads": n})
        -> ("ready", None)
    (peer, ids, max_new_tokens, eos_ids, ignore_eos, settings)
        -> ("ok", {"tokens", "marks", "start", "end"})
    None -> exit

Peers: `openvino` (plain), `openvino-sd` (the draft model; settings `num_assistant_tokens` or
`assistant_confidence_threshold`), `openvino-pld` (prompt lookup; `num_assistant_tokens`,
`max_ngram_size`), `openvino-gguf` (plain, GenAI reading the target's GGUF file itself). Greedy only:
the benchmark compares outputs token for token. Prompts arrive as token ids (our chat template
applied), so GenAI applies no template of its own; timing is taken here, by a streamer that stamps
every write (a speculative step writes its accepted tokens at once), as the other peers are timed.
"""

from __future__ import annotations

import sys
import time
from multiprocessing.connection import Connection

PEERS = ("openvino", "openvino-sd", "openvino-pld", "openvino-gguf")


class Child:
    def __init__(self, target: str, draft: str | None, gguf: str | None, threads: int):
        import openvino as ov
        import openvino_genai as genai

        self.ov, self.genai = ov, genai
        self.target, self.draft, self.gguf = target, draft, gguf
        self.props = {"INFERENCE_NUM_THREADS": threads}
        self.pipes: dict[str, object] = {}

    def pipe(self, peer: str):
        """Each peer's pipeline, made on its first request (GenAI fixes its mode when it is built)."""
        if peer not in self.pipes:
            g = self.genai
            if peer == "openvino":
                self.pipes[peer] = g.LLMPipeline(self.target, "CPU", **self.props)
            elif peer == "openvino-sd":
                if self.draft is None:
                    raise ValueError("peer openvino-sd needs the draft model's IR")
                self.pipes[peer] = g.LLMPipeline(self.target, "CPU", draft_model=g.draft_model(self.draft, "CPU", **self.props),
                                                 **self.props)
            elif peer == "openvino-pld":
                self.pipes[peer] = g.LLMPipeline(self.target, "CPU", prompt_lookup=True, **self.props)
            elif peer == "openvino-gguf":
                if self.gguf is None:
                    raise ValueError("peer openvino-gguf needs the target's GGUF file")
                # GenAI's GGUF reader takes the tokenizer from the exported IR's folder (its own
                # conversion fails its "tokenizers are equal" check)
                tokenizer = g.Tokenizer(self.target)
                self.pipes[peer] = g.LLMPipeline(self.gguf, tokenizer, "CPU", **self.props)
            else:
                raise ValueError(f"unknown OpenVINO peer '{peer}' (choose from {', '.join(PEERS)})")
        return self.pipes[peer]

    def generate(self, peer: str, ids: list[int], max_new_tokens: int, eos_ids: list[int], ignore_eos: bool,
                 settings: dict) -> dict:
        import numpy as np

        pipe = self.pipe(peer)
        config = pipe.get_generation_config()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        config.repetition_penalty = 1.0
        config.ignore_eos = ignore_eos
        if eos_ids:
            config.eos_token_id = eos_ids[0]
            config.stop_token_ids = set(eos_ids)
        for key, value in settings.items():
            setattr(config, key, value)
        marks: list[tuple[float, int]] = []
        genai = self.genai

        class Clock(genai.StreamerBase):
            def write(self, token):
                marks.append((time.perf_counter(), len(token) if isinstance(token, (list, tuple)) else 1))
                return genai.StreamingStatus.RUNNING

            def end(self):
                pass

        x = self.ov.Tensor(np.array([ids], dtype=np.int64))
        start = time.perf_counter()
        result = pipe.generate(x, config, Clock())
        end = time.perf_counter()
        return {"tokens": [int(t) for t in result.tokens[0]], "marks": marks, "start": start, "end": end}


def main(fd: int) -> None:
    conn = Connection(fd)
    child = None
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        try:
            if request[0] == "load":
                a = request[1]
                child = Child(a["target"], a.get("draft"), a.get("gguf"), a["threads"])
                conn.send(("ready", None))
            else:
                conn.send(("ok", child.generate(*request)))
        except Exception as e:  # noqa: BLE001 -- the parent reports it in one line
            conn.send(("error", f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))


if __name__ == "__main__":
    main(int(sys.argv[1]))
