"""Tree forward of Mamba2 layers vs transformers' own mixer run on each root path (reference path).

Oracle: ``unrolled_mixer_outputs`` runs every leaf path through ``Mamba2Mixer.forward`` as an
ordinary sequence from a transformers cache seeded with the prefix states; a packed tree must
give every node the same output. Errors are measured relative to max|oracle| (TOL table).
"""

import pytest
import torch
from transformers import Mamba2Config, Mamba2ForCausalLM
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

from draftforge.decode.targets.stree import (
    full_binary_parents,
    leaf_paths,
    mamba2_tree_logits,
    mixer_tree_forward,
    replay_states,
    root_path,
    seeded_cache,
    unrolled_mixer_outputs,
)
from draftforge.errors import CompatibilityError
from draftforge.hfcompat import cache_kwargs, output_cache

# Max |tree − oracle| / max |oracle|, per activation dtype (the oracle runs in the same dtype).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # bf16 measured ~6e-3


def tiny_config(**overrides):
    fields = dict(hidden_size=16, num_heads=4, head_dim=8, expand=2, n_groups=2, state_size=8,
                  conv_kernel=4, num_hidden_layers=2, vocab_size=64, chunk_size=8)
    fields.update(overrides)
    return Mamba2Config(**fields)


def random_mixer(config, seed=0):
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in mixer.parameters():
            param.normal_(0.0, 0.3)  # random A_log, dt_bias, D, conv and norm weights, not the init
    return mixer


def random_parents(n_nodes, gen):
    return [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n_nodes)]


def random_states(mixer, batch, gen):
    conv_BChK = torch.randn(batch, mixer.conv_dim, mixer.conv_kernel_size, generator=gen)
    ssm_BHPS = torch.randn(batch, mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, generator=gen)
    return conv_BChK, ssm_BHPS


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


TREES = {
    "one_node": [-1],
    "chain3_shorter_than_conv": list(range(-1, 2)),
    "chain9_longer_than_conv": list(range(-1, 8)),
    "binary_depth4": full_binary_parents(4),
    "binary_depth5": full_binary_parents(5),
    "binary_depth6": full_binary_parents(6),
    "star": [-1] + [0] * 6,
}


def assert_tree_equals_unrolled(mixer, config, hidden_BND, parents_BN, conv, ssm):
    """The reference tree forward equals the mixer run on each root path, within float32 tolerance."""
    want = unrolled_mixer_outputs(mixer, config, hidden_BND, parents_BN, conv, ssm)
    with torch.no_grad():
        got, _ = mixer_tree_forward(mixer, hidden_BND, parents_BN, conv, ssm, impl="ref")
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.parametrize("with_states", [False, True], ids=["empty_prefix", "random_states"])
@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_tree_matches_unrolled_paths(tree, with_states):
    config = tiny_config()
    mixer = random_mixer(config)
    gen = torch.Generator().manual_seed(1)
    parents_BN = torch.tensor([TREES[tree]])
    hidden_BND = torch.randn(1, parents_BN.shape[1], config.hidden_size, generator=gen)
    conv, ssm = random_states(mixer, 1, gen) if with_states else (None, None)
    assert_tree_equals_unrolled(mixer, config, hidden_BND, parents_BN, conv, ssm)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_of_random_trees(seed):
    # Different shapes per batch row, n_groups=1, and a dt limit that actually clamps.
    config = tiny_config(n_groups=1, time_step_limit=(0.05, 0.5))
    mixer = random_mixer(config, seed)
    gen = torch.Generator().manual_seed(seed)
    parents_BN = torch.tensor([random_parents(21, gen) for _ in range(3)])
    hidden_BND = torch.randn(3, 21, config.hidden_size, generator=gen)
    conv, ssm = random_states(mixer, 3, gen)
    assert_tree_equals_unrolled(mixer, config, hidden_BND, parents_BN, conv, ssm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_chain_reproduces_mixer_forward(dtype):
    config = tiny_config()
    mixer = random_mixer(config).to(dtype)
    hidden_BND = torch.randn(2, 11, config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        want = mixer(hidden_BND)
        got, _ = mixer_tree_forward(mixer, hidden_BND, list(range(-1, 10)), impl="ref")
    assert got.dtype == dtype
    assert rel_err(got, want) < TOL[dtype]


def test_bf16_tree_within_table_tolerance():
    config = tiny_config()
    mixer = random_mixer(config).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    parents_BN = torch.tensor([full_binary_parents(4)])
    hidden_BND = torch.randn(1, 15, config.hidden_size, generator=gen).bfloat16()
    conv, ssm = random_states(mixer, 1, gen)
    want = unrolled_mixer_outputs(mixer, config, hidden_BND, parents_BN, conv.bfloat16(), ssm.bfloat16())
    with torch.no_grad():
        got, _ = mixer_tree_forward(mixer, hidden_BND, parents_BN, conv.bfloat16(), ssm.bfloat16(), impl="ref")
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("node", [0, 2, 6, 13])
def test_replay_equals_scanning_the_path(node):
    config = tiny_config()
    mixer = random_mixer(config)
    gen = torch.Generator().manual_seed(5)
    parents = full_binary_parents(4)
    hidden_BND = torch.randn(1, 15, config.hidden_size, generator=gen)
    conv, ssm = random_states(mixer, 1, gen)
    with torch.no_grad():
        _, scan_cache = mixer_tree_forward(mixer, hidden_BND, parents, conv, ssm, impl="ref")
        cache = seeded_cache(config, 0, conv, ssm)
        mixer(hidden_BND[:, root_path(parents, node)], **cache_kwargs(mixer, cache))
    conv_got, ssm_got = replay_states(scan_cache, node)
    assert rel_err(conv_got, cache.get_conv_state(0)) < TOL[torch.float32]
    assert rel_err(ssm_got, cache.get_recurrent_state(0)) < TOL[torch.float32]
    conv_none, ssm_none = replay_states(scan_cache, -1)  # nothing accepted: the prefix states
    assert torch.equal(conv_none, conv) and torch.equal(ssm_none, ssm)


def check_model_tree_logits_and_replay(impl: str, device: str = "cpu") -> None:
    """Tree logits of a 2-layer Mamba2 LM equal each leaf path run as a sequence; replay equals its states."""
    config = tiny_config(num_hidden_layers=2)
    torch.manual_seed(6)
    model = Mamba2ForCausalLM(config).eval().to(device)
    prefix_1T = torch.randint(0, config.vocab_size, (1, 5), device=device)
    parents = full_binary_parents(3)
    tree_ids_1N = torch.randint(0, config.vocab_size, (1, 7), device=device)
    with torch.no_grad():
        cache = output_cache(model(prefix_1T, use_cache=True))
        logits_1NV, scan_caches = mamba2_tree_logits(model, tree_ids_1N, parents, cache, impl=impl)
        for path in leaf_paths(parents):
            full = model(torch.cat([prefix_1T, tree_ids_1N[:, path]], 1), use_cache=True)
            assert rel_err(logits_1NV[0, path], full.logits[0, 5:]) < 1e-4
            for layer, scan_cache in enumerate(scan_caches):
                conv, ssm = replay_states(scan_cache, path[-1])
                assert rel_err(conv, output_cache(full).get_conv_state(layer)) < 1e-5
                assert rel_err(ssm, output_cache(full).get_recurrent_state(layer)) < 1e-4


def test_model_tree_logits_and_replay_match_sequences():
    check_model_tree_logits_and_replay("ref")  # the kernel runs the same check in tests/kernels/test_tree_scan.py


def hybrid_mixers():
    from transformers import BambaConfig, NemotronHConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    common = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    bamba = BambaConfig(mamba_n_heads=4, mamba_d_head=8, mamba_expand=2, mamba_n_groups=2, mamba_d_state=8,
                        mamba_d_conv=4, attn_layer_indices=[], **common)
    nemotron = NemotronHConfig(mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4,
                               expand=2, hybrid_override_pattern="M", **common)
    return {"bamba": (BambaMixer, bamba), "nemotron_h": (NemotronHMamba2Mixer, nemotron)}


@pytest.mark.parametrize("name", ["bamba", "nemotron_h"])
def test_chain_reproduces_hybrid_mixer_forward(name):
    mixer_cls, config = hybrid_mixers()[name]
    torch.manual_seed(7)
    mixer = mixer_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for param in mixer.parameters():
            param.normal_(0.0, 0.3)
        hidden_BND = torch.randn(2, 7, 16)
        got, _ = mixer_tree_forward(mixer, hidden_BND, list(range(-1, 6)), impl="ref")
        assert rel_err(got, mixer(hidden_BND)) < TOL[torch.float32]


def test_unsupported_mixer_is_a_clear_error():
    with pytest.raises(CompatibilityError, match="not a Mamba2-style mixer"):
        mixer_tree_forward(torch.nn.Linear(4, 4), torch.zeros(1, 1, 4), [-1])
