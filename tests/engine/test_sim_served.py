"""The simulated engine's record of the prompts it was sent (``GET /debug/served``), which the benches read to
know where each router placed each request: a prompt has one key whether a router forwards its text or the
gateway sends its token ids."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from cache.tokens import ByteTokenizer, pack_token_ids
from engine.sim.server import prompt_key
from tests.engine.sim_nodes import StartSim, text_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from trace_workload import placements, same_placements


async def test_a_prompt_has_one_key_as_text_as_ids_and_as_packed_ids(start_sim: StartSim) -> None:
    sim = await start_sim()
    text, other = text_of(40), text_of(40, salt="other")
    ids = ByteTokenizer().encode(text)
    await sim.complete({"prompt": text, "max_tokens": 1})
    await sim.complete({"prompt_token_ids": ids.tolist(), "max_tokens": 1})
    await sim.chat({"prompt_token_ids_hex": pack_token_ids(ids), "max_tokens": 1})
    await sim.complete({"prompt": other, "max_tokens": 1})
    async with sim.session.get(f"{sim.url}/debug/served") as resp:
        assert resp.status == 200
        served = (await resp.json())["prompts"]
    key = prompt_key(ids)
    assert served == [key, key, key, prompt_key(ByteTokenizer().encode(other))]
    assert key != served[-1]


def test_placements_follow_each_engines_record_and_repeats_count_only_requests_placed_twice() -> None:
    # Prompts 1..4; prompt 2 sent twice (once to each engine); prompt 4 never reached an engine.
    served = [[1, 2], [3, 2]]
    where = placements([1, 2, 3, 2, 4], served)
    assert where == [0, 0, 1, 1, -1]
    assert same_placements(where, [0, 1, 1, 1, 0]) == 3 / 4  # the fifth is placed in one run only
    assert math.isnan(same_placements([-1, -1], [0, 1]))  # nothing placed in both runs to compare
