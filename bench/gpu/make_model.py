"""Write a random-weight llama GGUF of a realistic shape, on the spot: no download.

The default is Llama 3.2 1B's shape (16 blocks, embedding 2048, 32 query and 8 KV heads of
64, feed-forward 8192, a 128,256-token vocabulary, output tied to the token embedding) in
Q8_0 (1.3 GB) or f16 (2.5 GB). The weights are random bytes with a small scale, so a
decode step costs what the real model's costs; the text is nonsense. The end-of-sequence
row of the output is zero, so greedy generation never stops early and every job runs to
its num_predict. Tensors are generated and written one at a time: memory stays at the
largest tensor, not the file.

    python bench/gpu/make_model.py OUT.gguf                 # the 1B shape, Q8_0
    python bench/gpu/make_model.py OUT.gguf --type f16
    python bench/gpu/make_model.py OUT.gguf --layers 2      # a quick one (loads on a CPU)

Prints the shape and size, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
EOS = 2
WEIGHT_STD = 0.02  # the scale of the random weights (as in a trained model's init)


@dataclass(frozen=True)
class Shape:
    layers: int = 16
    embd: int = 2048
    ff: int = 8192
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 128_256
    context: int = 131_072
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.embd // self.heads


Tensor = tuple[str, tuple[int, ...], str]  # name, (rows, cols) or (n,), its type


def tensors(shape: Shape, qtype: str) -> list[Tensor]:
    """Every tensor of the model, in file order: (name, rows × cols, its type)."""
    e, kv = shape.embd, shape.head_dim * shape.kv_heads
    out: list[Tensor] = [("token_embd.weight", (shape.vocab, e), qtype)]
    out.append(("output_norm.weight", (e,), "f32"))
    if not shape.tied:
        out.append(("output.weight", (shape.vocab, e), qtype))
    for i in range(shape.layers):
        blk = f"blk.{i}"
        out += [
            (f"{blk}.attn_norm.weight", (e,), "f32"),
            (f"{blk}.attn_q.weight", (e, e), qtype),
            (f"{blk}.attn_k.weight", (kv, e), qtype),
            (f"{blk}.attn_v.weight", (kv, e), qtype),
            (f"{blk}.attn_output.weight", (e, e), qtype),
            (f"{blk}.ffn_norm.weight", (e,), "f32"),
            (f"{blk}.ffn_gate.weight", (shape.ff, e), qtype),
            (f"{blk}.ffn_up.weight", (shape.ff, e), qtype),
            (f"{blk}.ffn_down.weight", (e, shape.ff), qtype),
        ]
    return out


def q8_0(rows: int, cols: int, rng: np.random.Generator, zero_row: int = -1) -> np.ndarray:
    """Random Q8_0 blocks (an f16 scale, then 32 int8), as the bytes of ``rows`` rows."""
    n_blocks = rows * cols // 32
    block = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
    data = np.empty(n_blocks, dtype=block)
    data["d"] = np.float16(WEIGHT_STD / 73.0)  # uniform int8 has a std of ~73
    data["qs"] = np.frombuffer(rng.bytes(n_blocks * 32), dtype=np.int8).reshape(-1, 32)
    raw = data.view(np.uint8).reshape(rows, cols // 32 * block.itemsize)
    if zero_row >= 0:
        raw[zero_row] = 0
    return raw


def f16(rows: int, cols: int, rng: np.random.Generator, zero_row: int = -1) -> np.ndarray:
    ints = np.frombuffer(rng.bytes(rows * cols), dtype=np.int8).reshape(rows, cols)
    out = (ints.astype(np.float16) * np.float16(WEIGHT_STD / 73.0)).astype(np.float16)
    if zero_row >= 0:
        out[zero_row] = 0
    return out


def data_for(tensor: Tensor, shape: Shape, rng: np.random.Generator) -> np.ndarray:
    name, dims, kind = tensor
    if kind == "f32":
        return np.ones(dims, dtype=np.float32)
    rows, cols = dims
    # the logits of </s> are always 0, below the largest of the others: greedy never stops
    is_output = name == "output.weight" or (shape.tied and name == "token_embd.weight")
    make: Callable[..., np.ndarray] = q8_0 if kind == "q8_0" else f16
    return make(rows, cols, rng, EOS if is_output else -1)


def vocab(n: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then distinct word pieces up to ``n`` tokens."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    pieces = list(_words(n - len(tokens)))
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def _words(n: int) -> Iterator[str]:
    """The pieces: "▁", the letters, then "▁" and every word of 1, 2, 3 ... letters."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    made = 0
    for c in ["\u2581", *letters]:
        if made == n:
            return
        yield c
        made += 1
    level = [""]
    while True:
        level = [w + c for w in level for c in letters]
        for w in level:
            if made == n:
                return
            yield "\u2581" + w
            made += 1


def write_model(path: Path, shape: Shape, qtype: str = "q8_0", seed: int = 0) -> int:
    """Write the model to ``path``; returns its size in bytes."""
    if qtype not in ("q8_0", "f16"):
        raise ValueError(f"type {qtype!r} is not one of q8_0, f16")
    if shape.embd % 32 or shape.ff % 32 or shape.embd % shape.heads:
        raise ValueError(f"{shape}: embd and ff must be multiples of 32, embd of heads")
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    _metadata(writer, shape, qtype)
    layout = tensors(shape, qtype)
    raw = gguf.GGMLQuantizationType.Q8_0 if qtype == "q8_0" else None
    for name, dims, kind in layout:
        if kind == "q8_0":
            rows, cols = dims
            byte_shape = (rows, cols // 32 * 34)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), rows * byte_shape[1], raw)
        else:
            dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
            writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in layout:
        writer.write_tensor_data(data_for(tensor, shape, rng))
    writer.close()
    return path.stat().st_size


def _metadata(writer: gguf.GGUFWriter, shape: Shape, qtype: str) -> None:
    writer.add_name(f"random-llama-{shape.layers}L-{qtype}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.embd)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ff)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(500_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.MOSTLY_F16
    writer.add_file_type(file_type)
    tokens, scores, types = vocab(shape.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", default="q8_0", choices=["q8_0", "f16"])
    defaults = Shape()
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--embd", type=int, default=defaults.embd)
    parser.add_argument("--ff", type=int, default=defaults.ff)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--kv-heads", type=int, default=defaults.kv_heads)
    parser.add_argument("--vocab", type=int, default=defaults.vocab)
    parser.add_argument("--context", type=int, default=defaults.context)
    parser.add_argument("--untied", action="store_true", help="an output matrix of its own")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = Shape(
        layers=args.layers,
        embd=args.embd,
        ff=args.ff,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        context=args.context,
        tied=not args.untied,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    size = write_model(args.out, shape, args.type, args.seed)
    took = time.perf_counter() - started
    params = sum(int(np.prod(dims)) for _n, dims, _k in tensors(shape, args.type))
    print(
        f"{args.out}: random llama, {shape.layers} blocks, embd {shape.embd}, ff {shape.ff}, "
        f"heads {shape.heads}/{shape.kv_heads} (dim {shape.head_dim}), vocab {shape.vocab}, "
        f"{'tied' if shape.tied else 'untied'} output, {args.type}: {params / 1e9:.3f} B "
        f"parameters, {size / 2**20:.1f} MiB, written in {took:.1f} s"
    )
    summary = {"path": str(args.out), "type": args.type, "bytes": size, "params": params}
    print(json.dumps({"bench": "make_model", **summary, "shape": asdict(shape), "seconds": took}))


if __name__ == "__main__":
    main()
