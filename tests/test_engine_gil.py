"""The decode loop's short llama.cpp calls that keep the GIL (workers/engine/gil.py): bound
only where asked or where a GPU decodes, and answering as the plain bindings do."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from scheduler.protocol import Options, RunnerConfig
from tests.tinymodel import write_tiny_model
from workers.cpus import llama
from workers.engine.chains import ChainPool, safe_backends
from workers.engine.gil import KEPT, KeepsGil, keeping_gil
from workers.engine.loop import Engine

KEEPS_GIL = ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]  # a PyDLL's functions


def test_the_kept_calls_keep_the_gil_and_every_other_name_is_the_modules() -> None:
    L = llama()
    kept = KeepsGil(L)
    for name in KEPT:
        assert getattr(kept, name)._flags_ & KEEPS_GIL, name
        assert not getattr(L, name)._flags_ & KEEPS_GIL, name  # the module's own lets go
    assert kept.llama_decode is L.llama_decode  # a decode lets go of it
    assert kept.llama_synchronize is L.llama_synchronize


def test_the_gil_is_kept_where_asked_or_where_a_gpu_holds_every_layer() -> None:
    L = llama()
    assert keeping_gil(L, False) is L  # the CPU, or a model split with it
    assert isinstance(keeping_gil(L, False, keep=True), KeepsGil)
    assert keeping_gil(L, True, keep=False) is L
    offloaded = keeping_gil(L, True)  # every layer: kept where this build has a GPU
    assert isinstance(offloaded, KeepsGil) == bool(L.llama_supports_gpu_offload())


def at_once(engine: Engine, prompts: list[str], options: Callable[[int], Options]) -> list[str]:
    """Each prompt's answer, ``options(i)`` for the i-th, all generated at once, each from
    its own thread; the engine closed after."""
    texts = [""] * len(prompts)

    def one(i: int) -> None:
        texts[i] = engine.generate(prompts[i], options(i), lambda _t: None).text

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        engine.close()
    return texts


def answers(path: Path, keep_gil: bool) -> list[str]:
    """Four prompts at once on the tiny model, greedy, each from its own thread."""
    engine = Engine(str(path), RunnerConfig(256, 4), keep_gil=keep_gil, name=f"gil-{keep_gil}")
    assert engine.keeps_gil is keep_gil
    greedy = Options(num_predict=12, temperature=0, repeat_penalty=1.0)
    return at_once(
        engine, ["hello there", "hello again", "one two three", "the sky"], lambda _i: greedy
    )


def test_a_loop_that_keeps_the_gil_answers_as_one_that_lets_it_go(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    path = write_tiny_model(tmp_path_factory.mktemp("gil") / "tiny.gguf", "llama", n_embd=128)
    kept = answers(path, keep_gil=True)
    assert kept == answers(path, keep_gil=False)
    assert all(kept)


def chain_answers(path: Path, threads: int) -> list[str]:
    """Six prompts at once on the tiny model, each sampled by its seeded chain
    (temperature, top-k, top-p, penalties), its chains on ``threads`` threads."""
    engine = Engine(str(path), RunnerConfig(256, 6), chain_threads=threads, name=f"ch{threads}")
    assert engine._chains.threads == threads
    prompts = ["hello there", "hello again", "one two three", "the sky", "a b c", "zz"]

    def seeded(i: int) -> Options:
        return Options(num_predict=12, temperature=0.9, top_k=40, top_p=0.9, seed=i)

    texts = at_once(engine, prompts, seeded)
    assert (engine._chains.pooled > 0) == (threads > 1)  # the pool took the steps' chains
    return texts


def test_chains_sampled_on_several_threads_sample_what_one_thread_does(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The chain pool's threads read the logits the decode thread put in order, each
    chain with its own random state: the same tokens as sampled one after another."""
    path = write_tiny_model(tmp_path_factory.mktemp("chains") / "tiny.gguf", "llama", n_embd=128)
    pooled = chain_answers(path, threads=3)
    assert pooled == chain_answers(path, threads=1)
    assert len(set(pooled)) > 1  # seeded apart: a pool that mixed rows up would show


def test_the_pool_is_used_only_on_backends_whose_synchronize_threads_may_share() -> None:
    class Build:
        def __init__(self, info: bytes) -> None:
            self.info = info

        def llama_print_system_info(self) -> bytes:
            return self.info

    cuda = b"CUDA : ARCHS = 900 | USE_GRAPHS = 1 | CPU : SSE3 = 1 | AVX2 = 1 | "
    assert safe_backends(Build(cuda)) and safe_backends(Build(b"CPU : AVX2 = 1 | "))
    assert not safe_backends(Build(b"Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | "))
    assert not safe_backends(Build(b"Vulkan : | CPU : AVX2 = 1 | "))
    assert ChainPool(Build(cuda), None, 1 << 18, cores=1).threads == 1  # one core: no pool
    assert ChainPool(Build(b"Vulkan : | CPU : AVX2 = 1 | "), None, 1 << 18).threads == 1
