"""``kvgate engine`` as a process: the line it says once it serves names a URL a client can use."""

from __future__ import annotations

import socket
from pathlib import Path

import openai
import pytest

from tests.engine_process import engine_process


def test_an_engine_on_an_ipv6_address_says_a_url_that_reaches_it(tiny_model_dir: Path) -> None:
    # "http://::1:8000" (the host unbracketed) is no URL: a client given it cannot parse the port.
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    with engine_process(tiny_model_dir, kv_blocks=16, max_model_len=64, host="::1") as url:
        assert url.startswith("http://[::1]:"), url
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            assert [m.id for m in client.models.list().data] == [tiny_model_dir.name]
