"""GGUF -> HF conversion on a tiny llama GGUF this test writes itself with the `gguf` package."""

import json
import os

import gguf  # a core dependency (the SmolLM2 target ships as a GGUF): a missing one fails, it does not skip
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from draftforge.errors import CheckpointError, DraftforgeError
from draftforge.models.gguf import check_gguf, convert_gguf, load_gguf, supported_architectures

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, CONTEXT = 2, 32, 4, 2, 64, 128
TOKENS = SPECIALS + sorted(set(bytes_to_unicode().values())) + [m.replace(" ", "") for m in MERGES]


def write_tiny_gguf(path, arch="llama", arrays=None):
    """A 2-layer llama GGUF with a byte-level BPE tokenizer and chat template in its metadata (tied head).
    `arrays`, a dict, receives each tensor as written (GGUF name -> numpy array)."""
    tokens = TOKENS
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(CONTEXT)
    writer.add_block_count(LAYERS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3 = control
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(0)

    def add(name, *shape, ones=False, f16=False):
        a = np.ones(shape, np.float32) if ones else (rng.standard_normal(shape) * 0.2).astype(np.float32)
        a = a.astype(np.float16) if f16 else a
        writer.add_tensor(name, a)
        if arrays is not None:
            arrays[name] = a

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", len(tokens), HIDDEN)
    add("output_norm.weight", HIDDEN, ones=True)
    for i in range(LAYERS):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", HIDDEN, ones=True)
        add(b + "ffn_norm.weight", HIDDEN, ones=True)
        add(b + "attn_q.weight", HIDDEN, HIDDEN)
        add(b + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        add(b + "attn_v.weight", KV_HEADS * head_dim, HIDDEN, f16=True)  # a half tensor gets converted too
        add(b + "attn_output.weight", HIDDEN, HIDDEN)
        add(b + "ffn_gate.weight", FFN, HIDDEN)
        add(b + "ffn_up.weight", FFN, HIDDEN)
        add(b + "ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_converted_dir_loads_plainly_and_matches_the_gguf_model(tiny_gguf, tmp_path):
    old_umask = os.umask(0o027)
    try:
        out, _, _ = convert_gguf(tiny_gguf, tmp_path / "hf")
    finally:
        os.umask(old_umask)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {oct(0o640)}  # umask respected
    assert oct(out.stat().st_mode & 0o777) == oct(0o750)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == LAYERS
    assert config["tie_word_embeddings"] and config["max_position_embeddings"] == CONTEXT

    model = AutoModelForCausalLM.from_pretrained(out)  # no gguf_file: a standard HF directory
    tokenizer = AutoTokenizer.from_pretrained(out)
    ref_model, ref_tokenizer = load_gguf(tiny_gguf)
    assert model.config.model_type == "llama" and model.generation_config.eos_token_id == 2
    for text in ["hello world", "hello hello world world"]:
        assert tokenizer(text)["input_ids"] == ref_tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "hello"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_ids == ref_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_ids.endswith("<|im_start|>assistant\n")
    rows = [tokenizer(text)["input_ids"] for text in ("hello world hello", "world, hello world!")]
    ids_BT = torch.tensor([row[:4] for row in rows])
    with torch.no_grad():
        logits_BTV = model(ids_BT).logits
        ref_logits_BTV = ref_model(ids_BT).logits
    assert logits_BTV.shape[-1] == len(tokenizer)
    torch.testing.assert_close(logits_BTV, ref_logits_BTV, rtol=0, atol=0)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def _to_gguf_rope_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q / k rows from HF's rotate-half layout to interleaved pairs:
    rows (h, half, i) -> (h, i, half). The oracle for what a converted q / k projection must be."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_converted_weights_and_tokens_are_the_ones_the_file_holds(tmp_path):
    """Oracle: the arrays this test wrote and the merges it chose, not transformers' GGUF loader (which the
    conversion reads through: a drift there would show on both sides of the test above)."""
    arrays = {}
    out, _, _ = convert_gguf(write_tiny_gguf(tmp_path / "w.gguf", arrays=arrays), tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out)
    weights = {k: v.numpy() for k, v in model.state_dict().items()}
    assert np.array_equal(weights["model.embed_tokens.weight"], arrays["token_embd.weight"])
    for i in range(LAYERS):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in [("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"),
                             ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"),
                             ("post_attention_layernorm", "ffn_norm")]:
            assert np.array_equal(weights[f"{hf}{ours}.weight"], arrays[f"{gg}{theirs}.weight"]), ours
        assert np.array_equal(weights[f"{hf}self_attn.v_proj.weight"], arrays[f"{gg}attn_v.weight"].astype(np.float32))
        assert np.array_equal(_to_gguf_rope_order(weights[f"{hf}self_attn.q_proj.weight"], HEADS),
                              arrays[f"{gg}attn_q.weight"])
        assert np.array_equal(_to_gguf_rope_order(weights[f"{hf}self_attn.k_proj.weight"], KV_HEADS),
                              arrays[f"{gg}attn_k.weight"])
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hello world")["input_ids"] == [TOKENS.index("hello"), TOKENS.index("Ġworld")]  # the merges


def test_convert_replaces_an_earlier_conversion_but_not_files_it_did_not_write(tiny_gguf, tmp_path):
    out = tmp_path / "hf"
    convert_gguf(tiny_gguf, out, extra_files={"NOTE.txt": "old"})
    convert_gguf(tiny_gguf, out, extra_files={"NOTE.txt": "hi"})  # the same files: replaced
    assert (out / "NOTE.txt").read_text() == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    (out / "stale.txt").write_text("someone's")
    with pytest.raises(CheckpointError, match=r"holds files the new copy would not hold \(stale.txt\)"):
        convert_gguf(tiny_gguf, out, extra_files={"NOTE.txt": "again"})
    assert (out / "stale.txt").read_text() == "someone's" and (out / "NOTE.txt").read_text() == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = write_tiny_gguf(tmp_path / "bert.gguf", arch="bert")
    with pytest.raises(CheckpointError, match=r"architecture 'bert' is not supported; supported .*llama"):
        check_gguf(path)
    assert "llama" in supported_architectures() and "t5" not in supported_architectures()


def test_corrupt_truncated_and_missing_files(tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    cases = {"half.gguf": data[: len(data) // 2], "header.gguf": data[:200], "junk.gguf": b"not a gguf" * 50}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(CheckpointError, match="corrupt or truncated"):
            convert_gguf(tmp_path / name, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert issubclass(CheckpointError, DraftforgeError)
