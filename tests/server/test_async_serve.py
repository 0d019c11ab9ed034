"""`revolta serve --async-scheduling` (engine/async_step.py) through the official OpenAI SDK: concurrent streamed
completions (greedy with a stop string, greedy to max_tokens, seeded sampling) give the text and finish reasons of
the default deployment's server (MTP4: greedy and seeded tokens do not depend on drafting), and the startup summary
says the setting is on without the warning that it cannot apply."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from .conftest import MODEL, openai_client, run_server

PROMPTS = ["def fibonacci(n):", "import os\n", "The three largest cities are"]


def answers(url: str, jobs: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    """The jobs as concurrent streamed completions -> (text, finish reason) each."""
    oc = openai_client(url)

    def one(job: tuple[str, dict]) -> tuple[str, str]:
        prompt, kw = job
        text, finish = "", None
        for chunk in oc.completions.create(model=MODEL, prompt=prompt, max_tokens=24, stream=True, **kw):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_async_scheduling_serves_what_the_default_server_serves(server):
    full = openai_client(server.url).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24,
                                                        temperature=0).choices[0].text
    stop = full[6:9]
    jobs = [(PROMPTS[0], {"temperature": 0, "stop": [stop]}), (PROMPTS[1], {"temperature": 0}),
            (PROMPTS[2], {"temperature": 0.8, "seed": 7})]
    expected = answers(server.url, jobs)
    assert expected[0] == (full[:full.find(stop)], "stop")
    assert server.metric("revolta:async_scheduled_steps_total") == 0
    with run_server("--sse-keep-alive-interval", "0", "--async-scheduling",
                    "--speculative-config", '{"method": null}') as fast:
        assert answers(fast.url, jobs) == expected
        assert fast.metric("revolta:async_scheduled_steps_total") >= 10  # the steps did run ahead
        log = fast.log()
    assert any("async_scheduling" in line and "True" in line for line in log.splitlines()), log[-3000:]
    assert "every step runs synchronously" not in log
