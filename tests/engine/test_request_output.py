"""Request.output() (engine/request.py), made every step for a streamed request: the prompt ids are copied once per
request, not once per output (a 512K-token prompt cost milliseconds of the engine loop each step)."""

from __future__ import annotations

from revolta.engine import Request
from revolta.engine.sampling import SamplingParams


def test_outputs_share_one_copy_of_the_prompt_ids():
    prompt = list(range(1000))
    r = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    first = r.output()
    r.append(7, frozenset())
    second = r.output()
    assert first.prompt_token_ids == second.prompt_token_ids == prompt
    assert first.prompt_token_ids is second.prompt_token_ids and first.prompt_token_ids is not r.prompt_token_ids
    assert first.outputs[0].token_ids == [] and second.outputs[0].token_ids == [7]  # the outputs are snapshots
