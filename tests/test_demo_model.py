"""The real demo model (Gemma 3 270M) through the whole system, when installed."""

from __future__ import annotations

from api_client import Client
from tests.conftest import needs_demo


@needs_demo
def test_factual_prompt_at_temperature_zero(client: Client) -> None:
    result = client.generate(
        "gemma3-270m",
        "Water boils at a temperature of",
        options={"temperature": 0, "num_predict": 12},
    )
    assert "100" in result.response
    assert result.eval_count == 12 and result.done_reason == "length"


@needs_demo
def test_demo_model_streams_in_order(client: Client) -> None:
    chunks = list(
        client.generate(
            "gemma3-270m",
            "The three primary colors are",
            stream=True,
            options={"temperature": 0, "num_predict": 16},
        )
    )
    text = "".join(c.response for c in chunks[:-1])
    assert "red" in text.lower() and chunks[-1].done
    (runner,) = [r for r in client.ps() if r.model == "gemma3-270m"]
    assert runner.context_length == 4096 and runner.state == "ready"
