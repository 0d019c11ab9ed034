"""Soak: C concurrent streaming chats (text and image prompts, the official `openai` SDK) against a real `revolta
serve` for N minutes, proving flat memory (issue 26 item 4).

    python benchmarks/soak.py --minutes 30                              # embedded default, CPU or GPU
    python benchmarks/soak.py --minutes 30 --model DIR --out soak-h200  # a checkpoint; extra serve flags after --
    python benchmarks/soak.py --minutes 2 --check                       # the CI gates (tests/server/test_soak.py)

Every --sample-s seconds it records the server's RSS (psutil: the server process and its children), free KV blocks,
running/waiting requests and media bytes held (/metrics), generated tokens/s, draft acceptance (speculative
counters; empty without drafting), requests done and errors. It writes soak.csv and soak.png (matplotlib, when
installed) under --out and prints a summary:

* errors: failed requests (an SDK exception, or a stream that ended without a finish_reason);
* free KV blocks at the start (idle, before traffic) and at the end (idle, after the last request drained);
* RSS growth after warm-up: the lowest RSS of the last 5 sample intervals under load minus the lowest of the first
  5 after the warm-up (at least --warmup-s, and until every client has finished --warmup-requests requests, so
  each path, text and image, has run before the baseline is taken): the floor under load, which a leak raises,
  while a prefill's transient buffers come and go (a single reading can catch one: 30-70 MiB on the embedded
  default; on a slow machine several 2 s samples in a row can). RSS is read every 0.1 s; each row keeps its
  interval's lowest reading (rss_floor_mib) beside the reading at the sample (rss_mib). The CI gate is <= 16 MiB.

The server runs with glibc's mmap threshold held at its initial 128 KiB (MALLOC_MMAP_THRESHOLD_; a value already
in the environment is kept; --malloc-defaults runs glibc's defaults). By default glibc raises the threshold to the
size of each large block freed, so later transients of that size come from the heap and their pages stay resident
after free: the RSS floor then ratchets up, in rare steps, to the largest transient seen so far (+15-25 MiB at a
random point of a 2-minute run on the embedded default, flat again after; the Python heap, the tensors and
malloc's bytes in use stay flat). A held threshold returns large buffers on free, so the floor follows what the
server holds, and a leak (small objects from the heap or large blocks) still raises it, once it has filled the free
heap the model load left behind (~100 MiB on the embedded default): the 2-minute CI soak fails a leak of 4 MiB a
request (+177 MiB as one block, +179 MiB as 4 KiB objects), not one of 512 KiB a request (the free heap shrinks by
what leaks, RSS stays).

--check exits 1 unless errors == 0, free blocks end == start and RSS growth <= --max-rss-growth-mib.
"""

from __future__ import annotations

import argparse
import base64
import csv
import io
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MMAP_THRESHOLD = 128 * 1024  # glibc's initial M_MMAP_THRESHOLD; setting it stops the dynamic rise
WORDS = ("river stone cloud lamp orbit garden copper violet signal harbor lantern meadow quartz ember "
         "falcon glacier").split()


@dataclass
class Tally:
    """What the client threads count (under `lock`)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0
    errors: int = 0
    per_client: dict[int, int] = field(default_factory=dict)  # requests finished by each client
    messages: list[str] = field(default_factory=list)

    def add(self, client: int, error: str | None) -> None:
        with self.lock:
            self.done += 1
            self.per_client[client] = self.per_client.get(client, 0) + 1
            if error is not None:
                self.errors += 1
                if len(self.messages) < 5:
                    self.messages.append(error)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--model", help="checkpoint directory (default: the embedded default)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48,
                   help="most tokens per response (EOS ignored; each request draws from [max/2, max])")
    p.add_argument("--image-every", type=int, default=2, help="every k-th request of a client carries an image")
    p.add_argument("--warmup-s", type=float, default=30.0, help="shortest warm-up")
    p.add_argument("--warmup-requests", type=int, default=2, help="requests each client finishes in the warm-up")
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--out", default="soak-out", help="directory for soak.csv and soak.png")
    p.add_argument("--check", action="store_true", help="exit 1 unless the CI gates hold")
    p.add_argument("--max-rss-growth-mib", type=float, default=16.0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--malloc-defaults", action="store_true",
                   help="keep glibc's rising mmap threshold (the RSS floor then ratchets to the largest transient)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    return p.parse_args(argv[:argv.index("--")] if "--" in argv else argv), extra


def start_server(args: argparse.Namespace, extra: list[str], log: io.TextIOBase) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "revolta.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--sse-keep-alive-interval", "0", *extra]
    env = dict(os.environ)
    if not args.malloc_defaults:  # freed large buffers go back to the OS: RSS shows what is held (module docstring)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"revolta serve exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"revolta serve did not become healthy within {args.startup_timeout_s:g} s")
        time.sleep(0.2)


def lowest_rss(pid: int, until: float, every_s: float = 0.1) -> int:
    """The server's lowest RSS read every `every_s` until `until` (time.monotonic()): the dips between engine steps,
    which a 2 s sample alone mostly misses while long prefills keep their transients resident."""
    low = server_rss(pid)
    while (now := time.monotonic()) < until:
        time.sleep(min(every_s, until - now))
        low = min(low, server_rss(pid))
    return low


def metrics(url: str) -> dict[str, float]:
    """The label-free (but for model_name) samples of /metrics, by name."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and ("{" not in line or line.count("=") == 1):
            out[line.split("{")[0].split(" ")[0]] = float(line.rsplit(" ", 1)[1])
    return out


def server_rss(pid: int) -> int:
    import psutil

    proc = psutil.Process(pid)
    return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))


def png_url(seed: int) -> str:
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def client_loop(k: int, url: str, model: str, args: argparse.Namespace, images: list[str], deadline: float,
                tally: Tally) -> None:
    """One of the C clients: streamed chats back to back until the deadline, every image_every-th with an image."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="soak", max_retries=0, timeout=300)
    rng = random.Random(k)
    i = 0
    while time.monotonic() < deadline:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        content: object = text
        if args.image_every and i % args.image_every == args.image_every - 1:
            content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": rng.choice(images)}}]
        i += 1
        try:
            finish = None
            max_tokens = rng.randint(max(1, args.max_tokens // 2), args.max_tokens)  # desynchronises the clients
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, stream=True,
                extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
            tally.add(k, None if finish else "the stream ended without a finish_reason")
        except Exception as e:  # noqa: BLE001  every failure is counted and shown, the soak goes on
            tally.add(k, f"{type(e).__name__}: {e}"[:300])


def sample(url: str, pid: int, t0: float, tally: Tally, last: dict | None, floor: int | None = None) -> dict:
    """One row; `floor` is the lowest RSS (bytes) of the interval before it (lowest_rss), the reading if None."""
    m = metrics(url)
    now, rss = time.monotonic(), server_rss(pid)
    tokens = m.get("vllm:generation_tokens_total", 0.0)
    drafts = m.get("vllm:spec_decode_num_draft_tokens_total")
    accepted = m.get("vllm:spec_decode_num_accepted_tokens_total")
    row = {"t_s": round(now - t0, 2), "rss_mib": round(rss / 2**20, 3),
           "rss_floor_mib": round(min(rss, floor or rss) / 2**20, 3),
           "free_kv_blocks": int(m.get("revolta:kv_cache_free_blocks", -1)),
           "running": int(m.get("vllm:num_requests_running", 0)),
           "waiting": int(m.get("vllm:num_requests_waiting", 0)),
           "media_used_mib": round(m.get("revolta:media_memory_used_bytes", 0.0) / 2**20, 3),
           "requests_done": tally.done, "errors": tally.errors, "tokens": int(tokens), "tok_s": "", "acceptance": "",
           "_now": now, "_drafts": drafts, "_accepted": accepted}
    if last is not None:
        row["tok_s"] = round((tokens - last["tokens"]) / (now - last["_now"]), 2)
        if drafts is not None and last["_drafts"] is not None and drafts > last["_drafts"]:
            row["acceptance"] = round((accepted - last["_accepted"]) / (drafts - last["_drafts"]), 4)
    return row


def wait_ready(url: str, timeout: float = 60.0) -> None:
    """Until the engine loop has published its first stats (free KV blocks are 0 before that)."""
    deadline = time.monotonic() + timeout
    while metrics(url).get("revolta:kv_cache_free_blocks", 0) <= 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"/metrics showed no free KV blocks within {timeout:g} s")
        time.sleep(0.2)


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine did not drain within {timeout:g} s")
        time.sleep(0.2)


def summarize(rows: list[dict], start: dict, end: dict, warm_s: float | None, tally: Tally) -> dict:
    if warm_s is None:
        raise RuntimeError("the warm-up did not end before the deadline (some client finished fewer than "
                           "--warmup-requests requests); run longer or lower --max-tokens")
    loaded = [r for r in rows if r is not start and r is not end and r["t_s"] >= warm_s]
    if len(loaded) < 10:
        raise RuntimeError(f"only {len(loaded)} samples after the warm-up ({warm_s:g} s); run longer or sample more")
    floor_first = min(r["rss_floor_mib"] for r in loaded[:5])
    floor_last = min(r["rss_floor_mib"] for r in loaded[-5:])
    rates = [r["tok_s"] for r in loaded if r["tok_s"] != ""]
    accept = [r["acceptance"] for r in loaded if r["acceptance"] != ""]
    return {"requests": tally.done, "warmup_s": warm_s, "errors": tally.errors, "error_messages": tally.messages,
            "free_kv_blocks_start": start["free_kv_blocks"], "free_kv_blocks_end": end["free_kv_blocks"],
            "rss_mib_start": start["rss_mib"], "rss_mib_after_warmup": floor_first,
            "rss_mib_end": end["rss_mib"], "rss_growth_after_warmup_mib": round(floor_last - floor_first, 3),
            "tok_s_mean": round(sum(rates) / len(rates), 2) if rates else None,
            "acceptance_mean": round(sum(accept) / len(accept), 4) if accept else None}


def write_outputs(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cols = [c for c in rows[0] if not c.startswith("_")]
    with open(out / "soak.csv", "w", newline="") as f:
        w = csv.DictWriter(f, cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib); the CSV has every sample")
        return
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    t = [r["t_s"] / 60 for r in rows]
    for ax, key, label in zip(axes, ("rss_mib", "free_kv_blocks", "tok_s", "acceptance"),
                              ("server RSS (MiB)", "free KV blocks", "generated tokens/s", "draft acceptance")):
        pts = [(x, r[key]) for x, r in zip(t, rows) if r[key] != ""]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    out = Path(args.out)
    log = tempfile.NamedTemporaryFile("w", prefix="revolta-soak-", suffix=".log", delete=False)
    proc, url = start_server(args, extra, log)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        images = [png_url(s) for s in range(16)]
        tally = Tally()
        wait_ready(url)
        t0 = time.monotonic()
        rows = [sample(url, proc.pid, t0, tally, None)]
        start, deadline = rows[0], t0 + args.minutes * 60
        clients = [threading.Thread(target=client_loop, args=(k, url, model, args, images, deadline, tally),
                                    daemon=True) for k in range(args.concurrency)]
        for c in clients:
            c.start()
        warm_s = None
        while time.monotonic() < deadline:
            floor = lowest_rss(proc.pid, until=min(time.monotonic() + args.sample_s, deadline))
            rows.append(sample(url, proc.pid, t0, tally, rows[-1], floor))
            if warm_s is None and rows[-1]["t_s"] >= args.warmup_s and len(tally.per_client) == args.concurrency \
                    and min(tally.per_client.values()) >= args.warmup_requests:
                warm_s = rows[-1]["t_s"]
        for c in clients:
            c.join(timeout=300)
        wait_idle(url)
        rows.append(end := sample(url, proc.pid, t0, tally, rows[-1]))
        summary = summarize(rows, start, end, warm_s, tally)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    write_outputs(rows, out)
    print(f"soak: {args.minutes:g} min, C{args.concurrency}, {summary['requests']} requests, "
          f"{summary['errors']} errors; warm after {summary['warmup_s']:g} s; free KV blocks "
          f"{summary['free_kv_blocks_start']} -> {summary['free_kv_blocks_end']}; RSS "
          f"{summary['rss_mib_after_warmup']:.1f} MiB after warm-up, growth "
          f"{summary['rss_growth_after_warmup_mib']:+.2f} MiB; {summary['tok_s_mean']} tok/s; acceptance "
          f"{summary['acceptance_mean']}; CSV {out / 'soak.csv'}")
    for message in summary["error_messages"]:
        print("  error:", message)
    summary["passed"] = (summary["errors"] == 0 and summary["free_kv_blocks_end"] == summary["free_kv_blocks_start"]
                         and summary["rss_growth_after_warmup_mib"] <= args.max_rss_growth_mib)
    if summary["passed"]:
        os.unlink(log.name)
    else:
        print(f"  the server's log: {log.name}")
    summary["check"] = args.check
    return summary


if __name__ == "__main__":
    result = main()
    sys.exit(1 if result["check"] and not result["passed"] else 0)
