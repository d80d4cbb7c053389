"""Agent frameworks people run, unmodified, against a real gateway on the real stack
(issue 35): LangChain's ChatOpenAI and ChatOllama with tools and structured output, and
the OpenAI Agents SDK (over the Responses API) with one tool. The tiny model writes
random text, so its calls are forced: a named tool_choice, or a format in the generic
call form on Ollama's API (read back as a call by the gateway)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_ollama import ChatOllama
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI
from pydantic import BaseModel

ASK = "What is the weather in Rome?"


@tool
def get_weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture()
def llm(url: str) -> Iterator[ChatOpenAI]:
    chat = ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="x",
        model="tiny",
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    yield chat  # not closed: langchain-openai shares one httpx client between its models


def test_langchain_chat_openai_agent_loop(llm: ChatOpenAI) -> None:
    asked = [HumanMessage(ASK)]
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(asked)
    assert isinstance(called, AIMessage)
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome")
    answered = get_weather.invoke(call)  # the tool runs: a ToolMessage with its call's id
    assert answered.content == f"sunny in {call['args']['city']}"
    final = llm.bind_tools([get_weather]).invoke([*asked, called, answered], max_tokens=8)
    assert isinstance(final, AIMessage) and not final.tool_calls


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    degrees: int


def test_langchain_structured_output(llm: ChatOpenAI) -> None:
    found = llm.with_structured_output(Weather, method="json_schema").invoke(ASK)
    assert isinstance(found, Weather)


def test_langchain_chat_ollama_reads_a_call(url: str) -> None:
    parameters = get_weather.tool_call_schema.model_json_schema()
    call = {
        "type": "object",
        "properties": {"name": {"const": "get_weather"}, "arguments": parameters},
        "required": ["name", "arguments"],
    }
    generic: dict[str, Any] = {
        "type": "object",
        "properties": {
            "tool_calls": {"type": "array", "items": call, "minItems": 1, "maxItems": 1}
        },
        "required": ["tool_calls"],
    }
    llm = ChatOllama(base_url=url, model="tiny", temperature=0, num_predict=200, format=generic)
    try:
        message = llm.bind_tools([get_weather]).invoke(ASK)
    finally:
        llm._client._client.close()
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert message.content == ""


def test_openai_agents_sdk_runs_its_tool(url: str) -> None:
    set_tracing_disabled(True)

    @function_tool
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    async def run() -> str:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            agent = Agent(
                name="weather",
                instructions="Answer with the weather tool.",
                model=OpenAIResponsesModel(model="tiny", openai_client=client),
                tools=[weather],
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
                tool_use_behavior="stop_on_first_tool",
            )
            result = await Runner.run(agent, ASK, max_turns=2)
            return str(result.final_output)
        finally:
            await client.close()

    assert asyncio.run(run()) in ("sunny in Paris", "sunny in Rome")


@pytest.fixture(autouse=True)
def _no_network_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.setenv("LANGSMITH_TRACING", "false")
