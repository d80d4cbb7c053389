"""Write tiny random-weight llama GGUF files that llama.cpp loads and runs.

A byte-level SentencePiece-style vocabulary (<unk>, <s>, </s>, 256 byte tokens and a few
printable pieces) and two transformer blocks with grouped-query attention: a few hundred KB,
loads in milliseconds, generates (nonsense) text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def finish(writer: Any, path: Path) -> Path:
    """Write out what a GGUFWriter was given, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_slow_model(path: Path) -> Path:
    """A llama large enough that generating takes a while (~1 ms a token here), that never
    ends on its own: for tests that need a job still running when they act."""
    return write_tiny_model(
        path,
        n_embd=256,
        n_ff=768,
        n_head=8,
        n_head_kv=2,
        n_layer=4,
        context_length=8192,
        endless=True,
    )


def write_tiny_llama(path: Path, **kw: int) -> Path:
    return write_tiny_model(path, "llama", **kw)


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 2048,
    sliding_window: int = 64,
    seed: int = 0,
    endless: bool = False,
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    """A random-weight model of ``arch``: llama (GQA), qwen2 (QKV biases) or gemma3
    (sliding-window attention on 5 of every 6 layers, tied output, Q/K norms).

    ``endless`` (not gemma3): the end-of-sequence token's logit is always 0, below the
    largest of the others, so greedy generation runs until num_predict or the context."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, scores, types = _vocab()
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(sliding_window)
        writer.add_rope_freq_base(10000.0)
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(chat_template)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    n_embd_kv = head_dim * n_head_kv
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    if arch != "gemma3":  # gemma3 ties its output to the token embedding
        output = weight(n_vocab, n_embd)
        if endless:
            output[2] = 0.0  # </s>
        writer.add_tensor("output.weight", output)
    for i in range(n_layer):
        blk = f"blk.{i}"
        writer.add_tensor(f"{blk}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{blk}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"{blk}.attn_k.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"{blk}.attn_v.weight", weight(n_embd_kv, n_embd))
        writer.add_tensor(f"{blk}.attn_output.weight", weight(n_embd, n_embd))
        if arch == "qwen2":
            writer.add_tensor(f"{blk}.attn_q.bias", weight(n_embd))
            writer.add_tensor(f"{blk}.attn_k.bias", weight(n_embd_kv))
            writer.add_tensor(f"{blk}.attn_v.bias", weight(n_embd_kv))
        if arch == "gemma3":
            writer.add_tensor(f"{blk}.attn_q_norm.weight", ones(head_dim))
            writer.add_tensor(f"{blk}.attn_k_norm.weight", ones(head_dim))
            writer.add_tensor(f"{blk}.post_attention_norm.weight", ones(n_embd))
            writer.add_tensor(f"{blk}.post_ffw_norm.weight", ones(n_embd))
        writer.add_tensor(f"{blk}.ffn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{blk}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"{blk}.ffn_down.weight", weight(n_embd, n_ff))
    return finish(writer, path)


def _vocab() -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces += ["\u2581" + w for w in ("the", "sky", "is", "blue", "a", "and", "of", "to")]
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def write_unknown_arch(path: Path) -> Path:
    """A well-formed GGUF whose architecture llama.cpp does not know: loading must fail."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "notanarch")
    writer.add_context_length(512)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    return finish(writer, path)


def calibration_models(directory: Path) -> dict[str, Path]:
    """The tiny models the estimator is validated (and its compute constants fitted) on.

    Heads are 32 wide: llama.cpp's quantized KV types need the head size to be a multiple of
    their 32-value blocks."""
    directory.mkdir(parents=True, exist_ok=True)
    specs: dict[str, tuple[str, dict[str, int]]] = {
        "tiny-llama-gqa": ("llama", {"n_embd": 128, "context_length": 8192}),
        "tiny-llama-wide": (
            "llama",
            {
                "n_embd": 256,
                "n_ff": 768,
                "n_head": 8,
                "n_head_kv": 2,
                "n_layer": 3,
                "context_length": 8192,
            },
        ),
        "tiny-qwen2": ("qwen2", {"n_embd": 128, "context_length": 8192}),
        "tiny-gemma3-swa": ("gemma3", {"n_embd": 128, "n_layer": 6, "context_length": 8192}),
    }
    paths = {}
    for name, (arch, kw) in specs.items():
        path = directory / f"{name}.gguf"
        if not path.exists():
            write_tiny_model(path, arch, **kw)  # type: ignore[arg-type]
        paths[name] = path
    return paths
