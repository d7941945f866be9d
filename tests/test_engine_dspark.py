"""A dspark drafter's export loads in vLLM 0.32's own Qwen3DSparkModel, vLLM's Markov bias and
confidence equal ours, and vLLM's own sequential drafting loop drafts what replay drafts. Opt-in:
`pytest -m engine` (the vLLM CPU venv; about a minute).

vLLM drafts with DSpark only in its V2 model runner, which needs Triton's GPU backends: no CPU engine
serves it, so the served-equals-replay check (`evaluate.py --served vllm`, method dspark) needs a GPU.
Here vLLM's model is built outside an engine, the way its loader builds it (tests/vllm_dspark_load.py)."""

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from pipeline import TINY_TARGET
from pipeline.drafter import checkpoint
from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.model import Drafter
from tests.conftest import REPO
from tests.engines import build_venv, free_port

pytestmark = pytest.mark.engine
R = 16


def tiny_dspark(directory) -> Drafter:
    """A random dspark drafter for the shipped tiny target (its KV layout, taps 1, 3, 5), saved."""
    target = json.loads((TINY_TARGET / "config.json").read_text())
    c = DrafterConfig(
        hidden_size=target["hidden_size"],
        intermediate_size=448,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=target["vocab_size"],
        block_size=8,
        mask_token_id=target["vocab_size"] - 1,
        target_layer_ids=(1, 3, 5),
        num_target_layers=target["num_hidden_layers"],
        layer_types=("full_attention",),
        head="dspark",
        markov_rank=R,
    )
    g = torch.Generator().manual_seed(0)
    weights = load_file(TINY_TARGET / "model.safetensors")
    m = Drafter(c, weights["model.embed_tokens.weight"], weights["lm_head.weight"])
    m.init_weights(torch.Generator().manual_seed(1))
    with torch.no_grad():  # markov_w2 and the confidence bias start at zero: give them values to compare
        m.markov_head.markov_w2.weight.normal_(generator=g)
        m.confidence_head.proj.bias.fill_(0.25)
    checkpoint.save(directory, c, m.state_dict())
    return m


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    """Our random dspark drafter and what vLLM's own model and drafting loop made of its export."""
    tmp_path = tmp_path_factory.mktemp("vllm_dspark")
    m = tiny_dspark(tmp_path / "drafter")
    out = tmp_path / "result.json"
    subprocess.run(
        [
            str(build_venv()),
            str(REPO / "tests" / "vllm_dspark_load.py"),
            str(TINY_TARGET),
            str(tmp_path / "drafter"),
            out,
        ],
        check=True,
        env={**__import__("os").environ, "PORT": str(free_port())},
    )
    return m, json.loads(out.read_text())


def test_vllm_loads_the_dspark_export_and_computes_our_bias_and_confidence(vllm_run):
    m, r = vllm_run
    assert r["method"] == "dspark" and r["architectures"] == ["Qwen3DSparkModel"]
    assert r["head_parameters"] == [
        "model.confidence_head.proj.bias",
        "model.confidence_head.proj.weight",
        "model.markov_head.markov_w1.weight",
        "model.markov_head.markov_w2.weight",
    ]
    assert r["equal"] and all(r["equal"].values()), r["equal"]
    bf = m.to(torch.bfloat16)  # vLLM holds the heads in bf16 (the confidence head in fp32, from bf16 weights)
    prev = torch.tensor(r["prev"])
    with torch.no_grad():
        embed = bf.markov_head.embed(prev)
        ours = bf.markov_head.bias(embed).float()
        conf = torch.sigmoid(bf.confidence_head(torch.zeros(len(prev), bf.config.hidden_size), embed))
    torch.testing.assert_close(torch.tensor(r["bias"]), ours, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(r["confidence"]), conf, rtol=1e-6, atol=1e-6)


def test_vllm_drafts_a_dspark_block_as_replay_does(vllm_run):
    """vLLM's own sequential DSpark drafting (greedy, slot after slot, each slot biased by the token
    drafted before it, the anchor before slot 1) over normed backbone outputs: each slot's biased logits,
    along vLLM's drafts, are ours within one bf16 rounding at their largest magnitude; replay's
    chain_drafts drafts vLLM's tokens, and where it picks another one that is vLLM's maximum too within
    that rounding (bf16 logits tie exactly here; a CPU that rounds otherwise may break a tie otherwise), the
    block's later slots then follow another path and are not compared. Its confidence per slot is ours."""
    m, r = vllm_run
    bf = m.to(torch.bfloat16)
    h = torch.tensor(r["hidden"]).to(torch.bfloat16)[:, 1:]  # [n, B-1, H]: the masks' outputs
    first, drafts = torch.tensor(r["anchors"]), torch.tensor(r["drafts"])  # [n], [n, B-1]
    theirs = torch.tensor(r["draft_logits"])  # [n, B-1, V] fp32 of vLLM's bf16 biased logits
    prev = torch.cat([first[:, None], drafts[:, :-1]], dim=1)  # the token before each slot, on vLLM's path
    with torch.no_grad():
        base = bf.logits(h)
        along = (base + bf.markov_head.bias(bf.markov_head.embed(prev), base.dtype)).float()
        ours = bf.chain_drafts(h, first)  # [n, B-1]
        conf = torch.sigmoid(bf.confidence_head(h, bf.markov_head.embed(prev)))
    tol = 2**-8 * float(theirs.abs().max())  # half a bf16 spacing at the largest logit: one rounding
    torch.testing.assert_close(along, theirs, rtol=0, atol=tol)
    compared = 0
    for n in range(len(drafts)):
        for i in range(drafts.shape[1]):
            compared += 1
            assert float(theirs[n, i, ours[n, i]]) >= float(theirs[n, i].max()) - 2 * tol, (n, i)
            if ours[n, i] != drafts[n, i]:
                break  # a tie broken the other way: the paths part here
    assert compared >= drafts.numel() // 2
    assert (base.argmax(-1) != drafts).any()  # the Markov bias changes drafts here: the loop is the one tested
    torch.testing.assert_close(torch.tensor(r["draft_confidence"]), conf, rtol=1e-6, atol=1e-6)
