"""`revolta generate` and `revolta info`: output, exit codes, one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from revolta.cli import main

DATA = Path(__file__).parent / "data"


@pytest.fixture
def cache_env(default_dir, monkeypatch):
    monkeypatch.setenv("REVOLTA_CACHE", str(default_dir.parent))
    return default_dir


def _revolta() -> list[str]:
    exe = shutil.which("revolta")
    return [exe] if exe else [sys.executable, "-m", "revolta.cli"]


def test_generate_subprocess(cache_env):
    env = {**os.environ, "REVOLTA_CACHE": str(cache_env.parent)}
    proc = subprocess.run([*_revolta(), "generate", "--max-tokens", "12", "hello"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert "embedded default preset" in proc.stderr  # the startup summary
    # a CPU run's cache is no GPU's (the dry run for a GPU keeps vLLM's "GPU KV cache size")
    assert "KV cache size:" in proc.stderr and "GPU KV cache size" not in proc.stderr


def test_generate_in_process(cache_env, capsys):
    args = ["generate", "--max-tokens", "6", "--temperature", "0", "hello"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main([*args, "--no-stream"]) == 0
    assert capsys.readouterr().out == first and first.strip()
    assert main([*args, "--speculative-config", '{"method": null}']) == 0  # greedy: the same text without drafts
    assert capsys.readouterr().out == first
    assert main(["generate", "--max-tokens", "4", "--seed", "3", "--chat", "a", "b"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- [") == 2 and "length, 4 tokens" in out


def test_info(default_dir, capsys):
    config = DATA / "qwen3_8_flash_next_config.json"
    target = config if config.is_file() else default_dir
    assert main(["info", str(target)]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "kv" in out.lower()
    assert main(["info", str(default_dir), "--tp", "2"]) == 0
    assert "8 = 6 GDN + 2 QSA" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [
    (["info", "/no/such/dir"], "no such file or directory"),
    (["info", "{tmp}"], "no config.json"),
    (["info", "{tmp}/config.json"], "not valid JSON"),
    (["info", "{default}", "--tp", "0"], "--tp=0"),
    (["info", "{default}", "--tp", "3"], "use a tensor_parallel_size among 1, 2, 4"),
    (["info", "{real}", "--tp", "2", "--dcp", "2"], "decode_context_parallel_size=2 exceeds tensor_parallel_size / "
                                                    "num_key_value_heads = 2 / 2"),
    (["generate", "-tp", "3", "x"], "tensor_parallel_size=3 does not divide"),
    (["generate", "--model", "/no/such/dir", "x"], "not a directory"),
    (["generate", "--model", "{tmp}", "x"], "no config.json"),
    (["generate", "--top-p", "1.5", "x"], "--top-p=1.5"),
    (["generate", "--max-tokens", "0", "x"], "--max-tokens=0"),
    (["generate", "--speculative-config", '{"draft_policy": "never"}', "x"], "draft_policy='never'"),
])  # fmt: skip
def test_user_errors_are_one_line(argv, needle, tmp_path, default_dir, monkeypatch, capsys):
    monkeypatch.setenv("REVOLTA_CACHE", str(default_dir.parent))
    if "{tmp}/config.json" in argv:
        (tmp_path / "config.json").write_text("{not json")
    argv = [a.replace("{tmp}", str(tmp_path)).replace("{default}", str(default_dir))
            .replace("{real}", str(DATA / "qwen3_8_flash_next_config.json")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("revolta: error:")]) == 1
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


def test_bad_checkpoint_directory_subprocess(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = subprocess.run([*_revolta(), "info", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("revolta: error:")
    assert "not a Qwen3.8-Flash-Next" in proc.stderr and not proc.stdout


def test_usage_error_exit_code(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


def test_info_dry_run_plans_a_deployment(capsys):
    config = DATA / "qwen3_8_flash_next_config.json"
    assert main(["info", str(config), "--gpu-memory", "32", "--tp", "4", "--max-model-len", "524288",
                 "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    assert "GPU KV cache size:" in out and "Maximum concurrency for 524,288 tokens per request:" in out
    assert main(["info", str(config), "--gpu-memory", "32", "--tp", "4", "--dcp", "2", "--max-model-len", "524288",
                 "--kv-cache-dtype", "fp8_e4m3"]) == 0  # DCP is planned: each rank holds half its KV head's tokens
    assert "cache plan per GPU (TP 4, DCP 2," in capsys.readouterr().out
    assert main(["info", str(config), "--gpu-memory", "32", "--tp", "4", "--kv-cache-dtype", "fp9"]) == 2
    captured = capsys.readouterr()
    assert "fp9" in captured.err and captured.out == ""


def test_serve_passes_kv_cache_gib_to_the_llm(tmp_path, monkeypatch):
    """`--kv-cache-gib` (what the fitted-length warning names) reaches LLM(...); the server itself is not started."""
    seen = _fake_serve(tmp_path, monkeypatch)
    assert main(["serve", str(tmp_path), "--kv-cache-gib", "2.5", "--max-num-seqs", "3"]) == 0
    assert seen["kv_cache_gib"] == 2.5 and seen["max_num_seqs"] == 3 and seen["max_model_len"] is None
    assert "dflash2_graph_rounds" not in seen  # unset flags leave the LLM's defaults
    assert main(["serve", str(tmp_path), "--dflash2-graph-rounds", "--dflash2-draft-graph"]) == 0
    assert seen["dflash2_graph_rounds"] is True and seen["dflash2_draft_graph"] is True
    seen.clear()
    assert main(["serve", str(tmp_path), "--no-dflash2-graph-rounds"]) == 0  # the default is on: a way off
    assert seen["dflash2_graph_rounds"] is False and "dflash2_draft_graph" not in seen


def _fake_serve(tmp_path, monkeypatch, check_address=False):
    """LLM(...)'s keyword arguments and the ServerConfig of `revolta serve`, with neither model nor server started
    (nor, unless check_address, the port probed: another process may hold 8000)."""
    pytest.importorskip("fastapi")
    import revolta.cli
    import revolta.llm

    if not check_address:
        monkeypatch.setattr(revolta.cli, "_reserve_address", lambda host, port: None)
    import revolta.server.app

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)
            self.model_path, self.max_model_len = tmp_path, 4096

    monkeypatch.setattr(revolta.llm, "LLM", FakeLLM)
    monkeypatch.setattr(revolta.server.app, "run_server", lambda llm, config, *a, **k: seen.update(server=config) or 0)
    return seen


def test_serve_takes_the_vllm_engine_flags_the_llm_takes(tmp_path, monkeypatch):
    """The engine's own messages name gpu_memory_utilization and enforce_eager; serve must pass them on."""
    seen = _fake_serve(tmp_path, monkeypatch)
    assert main(["serve", str(tmp_path), "--gpu-memory-utilization", "0.85", "--block-size", "32", "--enforce-eager",
                 "--kv-offload-gib", "4", "--trust-remote-code", "--enable-auto-tool-choice",
                 "--tool-call-parser", "qwen3_coder", "--async-scheduling"]) == 0
    assert (seen["gpu_memory_utilization"], seen["block_size"], seen["enforce_eager"]) == (0.85, 32, True)
    assert seen["async_scheduling"] is True
    assert seen["kv_offload_gib"] == 4 and seen["trust_remote_code"] is True
    assert seen["server"].tool_call_parser == "qwen3_coder"
    seen.clear()
    assert main(["serve", str(tmp_path)]) == 0  # unset flags leave the LLM's defaults
    assert not {"gpu_memory_utilization", "block_size", "enforce_eager", "trust_remote_code",
                "async_scheduling"} & seen.keys()


@pytest.mark.parametrize("argv,needle", [
    (["--kernel-config", '{"ple_disk_cascade": false}'], "sm70_dflash2"),
    (["--safetensors-load-strategy", "lazy"], "--ple-placement disk"),
    (["--kv-transfer-config", "{}"], "--kv-offload-gib"),
    (["--chat-template", "t.jinja"], "the checkpoint's own chat template"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "none"], "--tool-call-parser none"),
])  # fmt: skip
def test_serve_refuses_vllm_flags_it_has_no_counterpart_for(argv, needle, tmp_path, monkeypatch, capsys):
    _fake_serve(tmp_path, monkeypatch)
    try:
        code = main(["serve", str(tmp_path), *argv])
    except SystemExit as e:  # argparse's own exit
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and argv[0] in err and needle in err and "unrecognized" not in err


def test_serve_with_several_served_model_names(tmp_path, monkeypatch, capsys):
    """vLLM takes several names (the first is reported); a second name must not be read as MODEL."""
    seen = _fake_serve(tmp_path, monkeypatch)
    assert main(["serve", "--served-model-name", "qwen", "flash", "--", str(tmp_path)]) == 0
    assert seen["server"].served_model_name == "qwen" and seen["server"].served_model_aliases == ("flash",)


def test_info_takes_serve_spellings_and_preset_names(default_dir, monkeypatch, capsys):
    """A vLLM user's -tp / --tensor-parallel-size and --max-num-batched-tokens work in `info` as in `serve`, and
    the embedded default is named as `generate` and `serve` name it."""
    monkeypatch.setenv("REVOLTA_CACHE", str(default_dir.parent))
    for flag in ("-tp", "--tensor-parallel-size"):
        assert main(["info", "default", flag, "2"]) == 0
        assert "8 = 6 GDN + 2 QSA" in capsys.readouterr().out
    config = str(DATA / "qwen3_8_flash_next_config.json")
    plans = []
    for budget in ("2048", "16384"):  # the batch budget sizes the activation estimate, so the pool
        assert main(["info", config, "--gpu-memory", "32", "--tensor-parallel-size", "4", "--max-model-len", "524288",
                     "--kv-cache-dtype", "fp8_e4m3", "--max-num-batched-tokens", budget]) == 0
        plans.append(next(line for line in capsys.readouterr().out.splitlines() if "GPU KV cache size:" in line))
    assert plans[0] != plans[1]


def test_serve_refuses_a_taken_port_before_loading(tmp_path, monkeypatch, capsys):
    """An address in use is a user error found before the model loads (minutes on a real checkpoint), not exit
    status 3 (which means a dead PLE worker) after it."""
    import socket

    seen = _fake_serve(tmp_path, monkeypatch, check_address=True)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and not seen
    assert main(["serve", str(tmp_path), "--port", str(port)]) == 0  # free again: it starts


def test_serve_holds_its_port_while_the_model_loads(tmp_path, monkeypatch):
    """`revolta serve` binds its address before the model loads and hands that socket to the server, so nothing
    started while it loads takes the port (a tensor-parallel run failed that way: a rank's gloo listener bound the
    ephemeral port the test had picked, and uvicorn then found it in use after the model had loaded)."""
    import socket

    import revolta.llm
    import revolta.server.app

    seen = _fake_serve(tmp_path, monkeypatch, check_address=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    class LoadingLLM:  # what starts while the model loads tries the port
        def __init__(self, **kwargs):
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port))
                    seen["taken_while_loading"] = True
                except OSError:
                    seen["taken_while_loading"] = False
            self.model_path, self.max_model_len = tmp_path, 4096

    monkeypatch.setattr(revolta.llm, "LLM", LoadingLLM)
    monkeypatch.setattr(revolta.server.app, "run_server",
                        lambda llm, config, host, port, **k: seen.update(bound=k["sock"].getsockname()[1])
                        or k["sock"].close() or 0)
    assert main(["serve", str(tmp_path), "--port", str(port)]) == 0
    assert seen["taken_while_loading"] is False and seen["bound"] == port


def test_generate_takes_serves_kv_cache_dtype(monkeypatch):
    """`generate --kv-cache-dtype` reaches LLM(...) as serve's does, with serve's help; unset, the LLM's default."""
    import revolta.cli
    import revolta.llm

    seen = {}

    class FakeLLM:
        def __init__(self, **kwargs):
            seen.clear()
            seen.update(kwargs)

        def close(self):
            pass

    monkeypatch.setattr(revolta.llm, "LLM", FakeLLM)
    monkeypatch.setattr(revolta.cli, "_print_generated", lambda llm, prompts, args: 0)
    assert main(["generate", "hi", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert seen["kv_cache_dtype"] == "fp8_e4m3"
    assert main(["generate", "hi"]) == 0
    assert "kv_cache_dtype" not in seen
    subs = revolta.cli.build_parser()._subparsers._group_actions[0].choices
    flag = {name: next(a for a in subs[name]._actions if "--kv-cache-dtype" in a.option_strings)
            for name in ("generate", "serve", "info")}
    assert {(a.help, a.choices, a.metavar) for a in flag.values()} == {(flag["serve"].help, flag["serve"].choices,
                                                                        flag["serve"].metavar)}
