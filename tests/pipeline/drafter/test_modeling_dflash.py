"""modeling_dflash.py, the file every checkpoint carries: `AutoModel.from_pretrained(DIR,
trust_remote_code=True)` builds our drafter from it, loads every tensor, and gives our Drafter's
logits; its spec_generate gives the target's own greedy output."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from pipeline.drafter import checkpoint, masks
from pipeline.drafter.model import Drafter
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader
from tests.drafters import TAPS, B, H, V, config, drafter

CONFIGS = {
    "full": {},
    "sliding_window_3": {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},
    "bidirectional_window": {"layer_types": ("sliding_attention",) * 2, "sliding_window": 3, "is_causal": False},
    "is_causal": {"is_causal": True},
    "partial_rotary": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    "linear_rope": {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
    "one_kv_head": {"num_key_value_heads": 1},
    "embedding_scale": {"input_embedding_scale": 0.5},
}


def from_pretrained(directory):
    return AutoModel.from_pretrained(str(directory), trust_remote_code=True, dtype=torch.float32).eval()


def ours(m: Drafter, hidden, block_ids) -> torch.Tensor:
    """Our Drafter's logits [b, Q, V] for one block anchored right after the context: hidden [b, S, T, H]."""
    b, S = hidden.shape[:2]
    Q = block_ids.shape[1]
    anchors, valid = torch.full((b, 1), S), torch.ones(b, 1, dtype=torch.bool)
    mk = masks.build(m.rules, anchors, valid, S, Q, "dense")
    pos = torch.arange(S + Q).expand(b, -1)
    with torch.no_grad():
        return m.logits(m(hidden, block_ids, pos[:, :S], pos[:, S:], mk))


def theirs(hf, m: Drafter, hidden, block_ids) -> torch.Tensor:
    """The same through the Hugging Face forward contract."""
    b, S = hidden.shape[:2]
    pos = torch.arange(S + block_ids.shape[1]).expand(b, -1)
    with torch.no_grad():
        h = hf(
            position_ids=pos, noise_embedding=F.embedding(block_ids, m.embed_tokens), target_hidden=hidden.flatten(2)
        )
    return F.linear(h, m.lm_head)


def block(anchor_tokens: torch.Tensor, size: int, mask_id: int) -> torch.Tensor:
    ids = torch.full((len(anchor_tokens), size), mask_id)
    ids[:, 0] = anchor_tokens
    return ids


def assert_loads_exactly(hf, tensors: dict) -> None:
    assert type(hf).__name__ == "DFlashDraftModel"
    state = hf.state_dict()
    assert set(state) == set(tensors)
    for k, v in tensors.items():
        assert torch.equal(state[k], v.float()), k


@pytest.mark.parametrize("name", list(CONFIGS))
def test_auto_model_is_our_drafter(tmp_path, name):
    m = drafter(config(**CONFIGS[name]))
    checkpoint.save(tmp_path / name, m.config, m.state_dict(), dtype=torch.float32)
    hf = from_pretrained(tmp_path / name)
    assert_loads_exactly(hf, m.state_dict())
    assert (hf.target_layer_ids, hf.block_size, hf.mask_token_id) == (list(TAPS), B, V - 1)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, 10, len(TAPS), H, generator=g)
    ids = block(torch.randint(0, V - 1, (2,), generator=g), B, V - 1)
    want, got = ours(m, hidden, ids), theirs(hf, m, hidden, ids)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)


def test_a_bf16_checkpoint_loads_the_same_tensors_as_ours(tmp_path):
    m = drafter(config(**CONFIGS["sliding_window_3"]))
    checkpoint.save(tmp_path / "ck", m.config, m.state_dict())  # bf16, the default
    c, tensors, _ = checkpoint.load(tmp_path / "ck")
    ref = Drafter(c, m.embed_tokens, m.lm_head).eval()
    checkpoint.load_into(ref, tensors)
    hf = from_pretrained(tmp_path / "ck")
    assert_loads_exactly(hf, tensors)
    hidden, ids = torch.randn(1, 7, len(TAPS), H), block(torch.tensor([3]), B, V - 1)
    assert torch.allclose(theirs(hf, ref, hidden, ids), ours(ref, hidden, ids), atol=1e-5, rtol=0)


def test_given_attention_mask_replaces_the_rule(tmp_path):
    m = drafter(config(**CONFIGS["sliding_window_3"]))
    checkpoint.save(tmp_path / "ck", m.config, m.state_dict(), dtype=torch.float32)
    hf = from_pretrained(tmp_path / "ck")
    hidden, pos = torch.randn(1, 6, len(TAPS) * H), torch.arange(6 + B)[None]
    noise = F.embedding(block(torch.tensor([3]), B, V - 1), m.embed_tokens)
    with torch.no_grad():
        built = hf(pos, noise_embedding=noise, target_hidden=hidden)
        everything = hf(pos, torch.ones(1, 1, B, 6 + B, dtype=torch.bool), noise, hidden)
        additive = hf(pos, torch.zeros(1, 1, B, 6 + B), noise, hidden)
    assert torch.allclose(everything, additive, atol=1e-6) and not torch.allclose(everything, built, atol=1e-3)
    with pytest.raises(NotImplementedError):
        hf(pos, noise_embedding=noise, target_hidden=hidden, past_key_values=object())


def test_without_auto_map_transformers_builds_a_plain_qwen3_model(tmp_path):
    """What auto_map prevents: a Qwen3Model that drops fc and hidden_norm and has a random embedding."""
    m = drafter()
    checkpoint.save(tmp_path / "ck", m.config, m.state_dict(), dtype=torch.float32)
    path = tmp_path / "ck" / "config.json"
    d = json.loads(path.read_text())
    del d["auto_map"]
    path.write_text(json.dumps(d))
    model, info = AutoModel.from_pretrained(str(tmp_path / "ck"), dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3Model"
    assert {"fc.weight", "hidden_norm.weight"} <= set(info["unexpected_keys"])
    assert "embed_tokens.weight" in info["missing_keys"]


def tiny_target_drafter(tmp_path, target):
    """A random drafter that fits the shipped tiny target (taps 1, 3, 5), loaded through AutoModel."""
    emb, head = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    c = config(
        hidden_size=128,
        vocab_size=4096,
        mask_token_id=4095,
        target_layer_ids=(1, 3, 5),
        block_size=6,
        num_target_layers=8,
        head_dim=32,
    )
    m = Drafter(c, emb.detach(), head.detach())
    m.init_weights(torch.Generator().manual_seed(0), std=0.2)
    checkpoint.save(tmp_path / "tiny", c, m.state_dict())
    return from_pretrained(tmp_path / "tiny")


def test_spec_generate_is_the_targets_greedy_output(tmp_path, target):
    hf = tiny_target_drafter(tmp_path, target)
    g = torch.Generator().manual_seed(1)
    for n in (1, 5, 17):
        prompt = torch.randint(3, 4000, (1, n), generator=g)
        with torch.no_grad():
            want = target.model.generate(prompt, max_new_tokens=20, do_sample=False)
        got = hf.spec_generate(target.model, prompt, max_new_tokens=20, stop_token_ids=target.eos_ids)
        assert got.tolist() == want.tolist(), n
        assert sum(a + 1 for a in hf.spec_stats["accepted"]) >= want.shape[1] - n
    with pytest.raises(NotImplementedError):
        hf.spec_generate(target.model, prompt, 4, temperature=0.7)


def test_trained_drafter_on_stored_states(small_store, trained_drafter, target):
    """The trained checkpoint through AutoModel: our logits on stored states, and spec_generate
    reproduces the stored greedy completions while accepting drafts."""
    store = HiddenStore(str(small_store))
    c, tensors, _ = checkpoint.load(trained_drafter)
    ref = Drafter(c, store.embedding("embed_tokens").float(), store.embedding("lm_head").float()).eval()
    checkpoint.load_into(ref, tensors)
    hf = from_pretrained(trained_drafter)
    assert_loads_exactly(hf, tensors)
    accepted = 0
    for s in list(ShardReader(store, 3))[:2]:
        for a in (s.prompt_len, len(s.tokens) - 2):
            hidden, ids = s.hidden[None, :a].float(), block(s.tokens[a : a + 1], c.block_size, c.mask_token_id)
            want, got = ours(ref, hidden, ids), theirs(hf, ref, hidden, ids)
            assert torch.allclose(got, want, atol=1e-4, rtol=0)
        prompt = s.tokens[None, : s.prompt_len]
        out = hf.spec_generate(
            target.model, prompt, max_new_tokens=len(s.tokens) - s.prompt_len, stop_token_ids=target.eos_ids
        )
        assert out[0].tolist() == s.tokens.tolist()
        accepted += sum(hf.spec_stats["accepted"])
    assert accepted > 0
