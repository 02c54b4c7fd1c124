"""EAGLE3 speculation with a random one-layer head built in-process, in both public
checkpoint layouts: greedy output equals plain decoding for k = 1, 3 and 5 over mixed requests
(length cutoff included), the target's auxiliary hidden states are the inputs of the layers
the head names, and bad heads are refused at start-up."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_engine_core_v2 import _engine, _run
from test_spec_decode import _requests

from faults import fails, injected
from ingot.engine.arg_utils import EngineArgs

H, HEADS, KV_HEADS, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 128, 259, 200


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """An 8-layer target: the default auxiliary layers are (2, 4, 5)."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-8")
    make_tiny_model("llama", path, vocab_size=VOCAB, num_hidden_layers=8)
    make_byte_tokenizer(path)
    return path


def _head_tensors(prefix: str, with_embedding: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    d = H // HEADS
    t = {
        "fc.weight": r(H, 3 * H),
        f"{prefix}.self_attn.q_proj.weight": r(HEADS * d, 2 * H),
        f"{prefix}.self_attn.k_proj.weight": r(KV_HEADS * d, 2 * H),
        f"{prefix}.self_attn.v_proj.weight": r(KV_HEADS * d, 2 * H),
        f"{prefix}.self_attn.o_proj.weight": r(H, HEADS * d),
        f"{prefix}.mlp.gate_proj.weight": r(INTER, H),
        f"{prefix}.mlp.up_proj.weight": r(INTER, H),
        f"{prefix}.mlp.down_proj.weight": r(H, INTER),
        f"{prefix}.input_layernorm.weight": 1 + r(H),
        f"{prefix}.hidden_norm.weight": 1 + r(H),
        f"{prefix}.post_attention_layernorm.weight": 1 + r(H),
        "norm.weight": 1 + r(H),
        "lm_head.weight": r(DRAFT_VOCAB, H),
        # draft token i is target token i + d2t[i]: the draft vocabulary skips 59 ids
        "d2t": torch.tensor([0] * 100 + [59] * 100, dtype=torch.int64),
        "t2d": torch.ones(VOCAB, dtype=torch.bool),
    }
    if with_embedding:
        t["embed_tokens.weight"] = r(VOCAB, H)
    return t


LLAMA_FIELDS = dict(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                    num_key_value_heads=KV_HEADS, vocab_size=VOCAB, rms_norm_eps=1e-6,
                    max_position_embeddings=512, num_hidden_layers=1)


def _save(path, layout: str, layers: int = 1, vocab: int = VOCAB, aux=None):  # noqa: ANN001
    path.mkdir(parents=True, exist_ok=True)
    fields = {**LLAMA_FIELDS, "num_hidden_layers": layers, "vocab_size": vocab}
    if layout == "eagle3":  # LlamaForCausalLMEagle3 checkpoints: "midlayer.", no embedding
        config = {**fields, "model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": DRAFT_VOCAB}
        if aux is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        tensors = _head_tensors("midlayer", with_embedding=False)
    else:  # the speculators format: "layers.0.", its own embedding
        config = {"speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB,
                  "transformer_layer_config": {**fields, "model_type": "llama"}}
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux
        tensors = _head_tensors("layers.0", with_embedding=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {layout: _save(root / layout, layout) for layout in ("eagle3", "speculators")}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def reference(target_dir, dtype):
    return _run(_engine(target_dir, 8, dtype=dtype), _requests())


def _eagle(path, k: int) -> dict:  # noqa: ANN001
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k,
            "adaptive": False}


@pytest.mark.parametrize("layout,k", [("eagle3", 1), ("eagle3", 3), ("speculators", 5)])
def test_greedy_identical_with_eagle3(target_dir, heads, reference, dtype, layout, k):
    engine = _engine(target_dir, 8, dtype=dtype, speculative_config=_eagle(heads[layout], k))
    _eagle3_keeps_the_tokens(engine, reference, k)


def test_eagle3_twin_one_wrong_draft_accepted_fails(target_dir, heads, reference, dtype):
    engine = _engine(target_dir, 8, dtype=dtype, speculative_config=_eagle(heads["eagle3"], 3))
    with injected("accepts_a_wrong_draft"), fails():
        _eagle3_keeps_the_tokens(engine, reference, 3)


def _eagle3_keeps_the_tokens(engine, reference, k: int) -> None:
    assert _run(engine, _requests()) == reference
    stats = engine.get_stats()["spec_decode"]
    # A random head rarely agrees with the target, but it drafted in every decode step.
    assert stats.num_drafts > 100 and stats.num_draft_tokens > stats.num_drafts * (k - 1)
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_aux_hidden_states_are_the_named_layers_inputs(target_dir):
    """The target leaves the inputs of layers (2, 4, 5), as HF computes them (hidden_states[i]
    is layer i's input)."""
    from paged_harness import PagedHarness
    from tiny import hf_model

    harness = PagedHarness(target_dir)
    harness.model.model.aux_hidden_state_layers = (2, 4, 5)
    ids = [5, 9, 33, 71, 2, 8, 100]
    harness.step([(0, ids, 0)])
    aux = harness.model.model.aux_hidden_states
    with torch.no_grad():
        ref = hf_model(target_dir)(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[2][0], ref[4][0], ref[5][0]], dim=-1)
    assert aux.shape == (len(ids), 3 * H)
    assert torch.allclose(aux, want, atol=1e-4), (aux - want).abs().max()
    # The broken case: another layer's input does not match.
    assert not torch.allclose(aux[:, :H], ref[3][0], atol=1e-4)


@pytest.mark.needs_kernels
def test_cpu_decode_path_leaves_the_same_aux_states(tmp_path):
    """bf16 decode through ingot's CPU kernels (no modules) leaves what the module path does
    (head_dim 32: the kernels' smallest)."""
    from tiny import make_tiny_model

    from ingot.engine.arg_utils import EngineArgs as Args
    from ingot.model_executor.binding import attention_heads, bind, select_kernels
    from ingot.model_executor.layers.attention import AttentionMetadata
    from ingot.model_executor.layers.attention_backend import select_attention_backend
    from ingot.model_executor.loader.model_loader import load_model
    from ingot.worker.execution.decode_program import BackendDecodeProgram
    from ingot.worker.execution.program import EagerProgram

    make_tiny_model("llama", tmp_path, vocab_size=VOCAB, num_hidden_layers=8,
                    num_attention_heads=2, num_key_value_heads=1)
    config = Args(model=str(tmp_path), dtype="bfloat16").create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    backend = select_attention_backend(torch.device("cpu"), torch.bfloat16, torch.bfloat16,
                                       False, attention_heads(model))
    kernels = select_kernels(model, torch.bfloat16, torch.device("cpu"))
    fast = bind(model, backend, kernels).decode_program
    assert fast is not None
    model.model.aux_hidden_state_layers = (2, 4, 5)
    shape = (2, 8, 4, 1, 32)
    results = []
    # The decode program's path, then the modules' (the program it wraps).
    for program in (BackendDecodeProgram(EagerProgram(model), fast), EagerProgram(model)):
        kv = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(8)]
        pos = torch.tensor([0, 0])
        meta = AttentionMetadata.build(pos, [1, 1], torch.tensor([4, 8]),
                                       torch.tensor([[1], [2]]), block_size=4, is_decode=True)
        with torch.inference_mode():
            program.forward(torch.tensor([7, 40]), pos, kv, meta)
        results.append(model.model.aux_hidden_states.clone())
    assert results[0].shape == (2, 3 * H)
    assert torch.equal(results[0], results[1])


def test_bad_heads_are_refused(target_dir, tmp_path):
    cases = [
        (_save(tmp_path / "two", "eagle3", layers=2), "exactly one decoder layer"),
        (_save(tmp_path / "vocab", "eagle3", vocab=300), "embeds 300 tokens"),
        (_save(tmp_path / "aux", "speculators", aux=[2, 4, 9]), "three layer indices"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(target_dir),
                       speculative_config=_eagle(path, 2)).create_engine_config()


def test_aux_layers_from_the_head_config(target_dir, tmp_path):
    path = _save(tmp_path / "h", "eagle3", aux=[1, 3, 6])
    config = EngineArgs(model=str(target_dir),
                        speculative_config=_eagle(path, 2)).create_engine_config()
    assert config.speculative_config.aux_layer_ids == (1, 3, 6)
    path = _save(tmp_path / "d", "speculators")
    config = EngineArgs(model=str(target_dir),
                        speculative_config=_eagle(path, 2)).create_engine_config()
    assert config.speculative_config.aux_layer_ids == (2, 4, 5)
