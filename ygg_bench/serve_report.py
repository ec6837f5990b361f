"""`ygg bench-serve`'s summary.md: each method at each concurrency level, the KV cache and /metrics
during the load, the methods through Ray Serve against the same served directly, and against the
serving peers."""

from __future__ import annotations

from ygg_bench import harness
from ygg_bench.clients import SCRAPE_S

def summary_markdown(report: dict) -> str:
    cfg, mach = report["config"], report["machine"]
    bandwidth = f", {mach['read_bandwidth_gbs']} GB/s read" if mach.get("read_bandwidth_gbs") else ""
    lines = ["# Yggdrasil serving benchmark", "",
             f"- **Command**: `{cfg['command']}`{harness.at_revision(report)}",
             f"- **Machine**: {mach['cpu']}{bandwidth}, {mach['threads']} torch threads; {mach['dtype']} on "
             f"{mach['device']}",
             f"- **Load**: {cfg['prompts']} prompts per (method, concurrency), "
             + ("chat requests without max_tokens (each answer runs to its end of turn or the context)"
                if cfg.get("chat") else f"{cfg['max_new_tokens']} new tokens at most")
             + f", greedy, closed loop; CAST allocation {'on' if cfg['cost_aware'] else 'off'}; KV cache "
             + (f"{cfg['kv_cache_gb']:g} GiB" if cfg.get("kv_cache_gb") else "the server's default"),
             "",
             "| method | concurrency | tokens/s | × own c=1 | × ar | TPOT p50 / p95 / p99 ms | TTFT p50 / p95 / p99 ms | "
             "sequences/step | nodes/sequence | acceptance | outputs = ar |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, spec=".1f"):
        return "–" if v is None else f"{v:{spec}}"

    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        lines.append(f"| {r['method']} | {r['concurrency']} | {f(r['tokens_per_s'])} | {f(r['scaling_vs_lowest'], '.2f')} "
                     f"| {f(r['tokens_per_s_vs_ar'], '.2f')} | {f(r['tpot_ms_p50'])} / {f(r['tpot_ms_p95'])} / "
                     f"{f(r.get('tpot_ms_p99'))} | {f(r['ttft_ms_p50'], '.0f')} / {f(r.get('ttft_ms_p95'), '.0f')} / "
                     f"{f(r.get('ttft_ms_p99'), '.0f')} | {f(r['mean_sequences_per_step'], '.2f')} "
                     f"| {f(r['nodes_per_sequence'], '.2f')} | {f(r['acceptance_rate'], '.2f')} "
                     f"| {r['outputs_equal_ar'] or '–'} |")
    lines += ["", "nodes/sequence: tree nodes verified per sequence per step (root included; 1 = plain decoding), "
              "from the server's ygg:batch_verified_nodes and ygg:batch_steps counters.", "",
              "## The KV cache during the load", "",
              "From /metrics around each level: the most requests running at once (sampled), preemptions, and "
              "the tokens the running requests had written per GiB of cache their regions held, over its steps — against "
              "reserving each request's max_tokens (the rest of the context, for a chat request without one) up "
              "front, as the server did before it held only what a request had written, for the same requests.", "",
              "| method | concurrency | running at most | preemptions | tokens per GiB held | reserved up front | × |",
              "|---|---|---|---|---|---|---|"]
    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        if r.get("peer") or r.get("kv_tokens_per_gb") is None:
            continue
        now, before = r["kv_tokens_per_gb"], r["kv_tokens_per_gb_upfront"]
        lines.append(f"| {r['method']} | {r['concurrency']} | {f(r['running_peak'], '.0f')} | {f(r['preemptions'], '.0f')} "
                     f"| {now:,.0f} | {f(before, ',.0f')} | {f(now / before if before else None, '.1f')} |")
    lines += ["",
              "## /metrics during the load", "",
              f"Scraped every {SCRAPE_S:g} s while each level ran, and before and after it: the server's own account "
              "against the clients' (generated tokens, finished requests; accepted tokens per position summing to "
              "accepted tokens; generated tokens never falling between scrapes).", "",
              "| method | concurrency | scrapes | generated (server / clients) | requests (server / clients) | drafts "
              "| draft tokens | accepted | agree |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
        m = r.get("metrics")
        if not m:
            continue
        lines.append(f"| {r['method']} | {r['concurrency']} | {m['scrapes_during_run']} | {m['generation_tokens']:.0f} / "
                     f"{r['tokens']} | {m['requests_finished']:.0f} / {r['requests']} | {m['drafts']:.0f} | "
                     f"{m['draft_tokens']:.0f} | {m['accepted_tokens']:.0f} | "
                     f"{'yes' if r['metrics_agree'] else 'NO'} |")
    for peer, why in (cfg.get("left_out") or {}).items():
        lines += ["", f"Left out: **{peer}**, {why}"]
    if cfg.get("ray"):
        lines += ["", "## Through Ray Serve", "",
                  "Each method through `ygg serve --ray` (" + ", ".join(
                      f"{r['name']}: {r['replicas']} replica(s) of {r['threads_each']} thread(s)" for r in cfg["ray"])
                  + f") over the same method served directly ({mach['threads']} threads), at the same concurrency, "
                  "in the same run: ratios above 1 are Ray's cost for TTFT and TPOT, its gain for tokens/s. "
                  "Idle Ray: the cores the processes of the Rays not under load took while the direct level "
                  "ran (a Ray idling beside a server slows it).", "",
                  "| through | method | concurrency | tokens/s × | TTFT p50 × | TPOT p50 × | idle Ray, cores |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
            if v := r.get("vs_direct"):
                lines.append(f"| {r['via']} | {r['method'].split('@')[0]} | {r['concurrency']} "
                             f"| {f(v['tokens_per_s'], '.3f')} | {f(v['ttft_ms_p50'], '.3f')} "
                             f"| {f(v['tpot_ms_p50'], '.3f')} | {f(r['direct_background_cores'], '.3f')} |")
    if cfg.get("peers"):
        lines += ["", "## Against the serving peers", "",
                  "Ours over theirs at the same concurrency, on the same prompts (tokens/s: higher is better for us; "
                  "TTFT p50: lower). The peer's 'outputs = ar' column above is its text against our ar's: not "
                  "required to agree, its batch shapes change its numerics.", "",
                  "| method | concurrency | peer | tokens/s × | TTFT p50 × |", "|---|---|---|---|---|"]
        for r in sorted(report["summary"], key=lambda r: (r["method"], r["concurrency"])):
            for p, v in (r.get("vs_peers") or {}).items():
                lines.append(f"| {r['method']} | {r['concurrency']} | {p} | {v['tokens_per_s']:.2f} "
                             f"| {v['ttft_ms_p50']:.2f} |")
    return "\n".join(lines + [""])
