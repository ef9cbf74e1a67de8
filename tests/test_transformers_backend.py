"""The Hugging Face transformers experts backend (experts_implementation="compiled_moe").

Tiny random models of four MoE families (no downloads): logits and the gradients of every
parameter and of the input embeddings against transformers' own "eager" experts, in float64
(tight) and float32 (DESIGN.md's rule against a float64 run); standalone experts modules with
every flag of ``use_experts_implementation`` against transformers' "batched_mm" backend; the
activation recognition; that the backend really runs compiled_moe.moe_experts; the ways to
switch a model to it; torch.compile. GPU tier: bf16 on CUDA against an fp32 eager run.
"""

import copy
import inspect
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import compiled_moe  # noqa: E402
from compiled_moe.integrations import transformers as backend  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402
from transformers.configuration_utils import PretrainedConfig  # noqa: E402

H = 64  # hidden size of the tiny models

# Post-expert norms and expert-parallel sentinels exist in the decorator from transformers 5.2x.
HAS_POST_NORM = "has_post_expert_norm" in inspect.signature(use_experts_implementation).parameters


def _configs():
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig
    common = dict(vocab_size=96, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  tie_word_embeddings=False)
    return {
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
            head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "mixtral": lambda: MixtralConfig(
            **common, intermediate_size=48, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=2),
        "gpt_oss": lambda: GptOssConfig(
            **common, intermediate_size=32, num_key_value_heads=2, head_dim=16,
            num_local_experts=8, num_experts_per_tok=4, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"]),
        "deepseek_v3": lambda: DeepseekV3Config(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
            n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=3, n_group=2,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=8),
    }


CONFIGS = _configs()
# The activation each family's experts must be recognised as (activation, layout).
EXPECTED_ACTIVATION = {"qwen3_moe": ("swiglu", "stacked"), "mixtral": ("swiglu", "stacked"),
                       "gpt_oss": ("gpt_oss", "interleaved"),
                       "deepseek_v3": ("swiglu", "stacked")}


def _experts_modules(model):
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "down_proj")]


def _build(name, dtype=torch.float64, device="cpu", seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="eager",
                                             experts_implementation="eager", dtype=dtype)
    model.to(device)
    # The default init (std 0.02) keeps FC1's output near 0, where every gate looks linear:
    # widen it so gates, clamps (GPT-OSS's limit 7) and biases are all exercised.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in _experts_modules(model):
            for pname, p in m.named_parameters():
                if pname.endswith("bias"):
                    std = 0.5
                elif pname == "down_proj":
                    std = 1.0 / p.shape[-2 if m.is_transposed else -1] ** 0.5
                else:
                    std = 4.0 / H ** 0.5
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)
    model.eval()  # no dropout; gradients still flow
    return model


def _inputs(model, device="cpu", seed=0, batch=2, seq=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    cot = torch.randn(batch, seq, model.config.vocab_size, generator=g, dtype=torch.float64)
    return ids.to(device), cot.to(device)


def _run(model, ids, cot, impl):
    """Logits, d loss / d inputs_embeds and every parameter's gradient under one backend."""
    model.set_experts_implementation(impl)
    assert model.config._experts_implementation == impl
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb).logits
    (logits * cot.to(logits.dtype)).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "inputs_embeds": emb.grad.detach(), **grads}


def _expert_param_names(model):
    names = set()
    for mod_name, m in model.named_modules():
        if m in _experts_modules(model):
            names |= {f"{mod_name}.{p}" for p, _ in m.named_parameters()}
    return names


def _err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def _rel_fro(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _check_design_rule(ours, eager, ref, eps, what, keys=None, relative_norm=False):
    """DESIGN.md: our error against the reference <= 2x the framework's same-dtype error + atol.

    The error is the max abs difference (atol relative to the reference's max), or with
    ``relative_norm`` the relative Frobenius norm of the difference (atol relative).
    """
    assert ours.keys() == eager.keys() == ref.keys()
    for key in keys if keys is not None else ref:
        if relative_norm:
            e_ours, e_eager, atol = _rel_fro(ours[key], ref[key]), _rel_fro(eager[key], ref[key]), eps
        else:
            scale = ref[key].abs().max().item()
            atol = 32 * eps * max(scale, 1e-30)
            e_ours, e_eager = _err(ours[key], ref[key]), _err(eager[key], ref[key])
        assert e_ours <= 2 * e_eager + atol, (
            f"{what} {key}: error {e_ours:.3g} > 2 x eager's {e_eager:.3g} + {atol:.3g}")


class CallCounter:
    """Wraps compiled_moe.moe_experts: the backend must call it, not fall back to eager."""

    def __init__(self, monkeypatch):
        self.calls = 0
        self._fn = compiled_moe.moe_experts
        monkeypatch.setattr(compiled_moe, "moe_experts", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._fn(*args, **kwargs)


# ------------------------------------------------------------------------------------------
# Whole models on the CPU
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=list(CONFIGS))
def model64(request):
    return request.param, _build(request.param, torch.float64)


def test_models_float64_match_eager(model64):
    name, model = model64
    ids, cot = _inputs(model)
    eager = _run(model, ids, cot, "eager")
    ours = _run(model, ids, cot, "compiled_moe")
    assert ours.keys() == eager.keys()
    assert _expert_param_names(model) <= ours.keys(), "every expert parameter gets a gradient"
    for key in eager:
        scale = eager[key].abs().max().item()
        assert _err(ours[key], eager[key]) <= 1e-11 * max(scale, 1.0), key


def test_models_float32_design_rule(model64):
    name, model64_ = model64
    ids, cot = _inputs(model64_)
    ref = _run(model64_, ids, cot, "eager")
    model32 = copy.deepcopy(model64_).to(torch.float32)
    eager = _run(model32, ids, cot, "eager")
    ours = _run(model32, ids, cot, "compiled_moe")
    _check_design_rule(ours, eager, ref, torch.finfo(torch.float32).eps, name)
    for key in eager:  # and directly: the two fp32 runs agree to fp32 rounding
        scale = eager[key].abs().max().item()
        assert _err(ours[key], eager[key]) <= 1e-4 * max(scale, 1e-6), key


def test_models_recognise_activation(model64):
    name, model = model64
    ids, _ = _inputs(model)
    model.set_experts_implementation("compiled_moe")
    backend.reset_activation_cache(model)
    with torch.no_grad():
        model(input_ids=ids)
    for m in _experts_modules(model):
        act, layout, alpha, limit = getattr(m, "_compiled_moe_activation")
        assert (act, layout) == EXPECTED_ACTIVATION[name]
        if act == "gpt_oss":
            assert (alpha, limit) == (m.alpha, m.limit)


def test_backend_calls_moe_experts(model64, monkeypatch):
    name, model = model64
    ids, _ = _inputs(model)
    counter = CallCounter(monkeypatch)
    n_moe = len(_experts_modules(model))
    assert n_moe >= 1
    model.set_experts_implementation("eager")
    with torch.no_grad():
        model(input_ids=ids)
    assert counter.calls == 0
    model.set_experts_implementation("compiled_moe")
    with torch.no_grad():
        model(input_ids=ids)
    assert counter.calls == n_moe


# ------------------------------------------------------------------------------------------
# Registration and the ways to switch a model
# ------------------------------------------------------------------------------------------

def test_register_is_idempotent():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    backend.register()
    backend.register()
    assert ALL_EXPERTS_FUNCTIONS["compiled_moe"] is backend.experts_forward
    assert ExpertsInterface()["compiled_moe"] is backend.experts_forward
    assert "compiled_moe" in ALL_EXPERTS_FUNCTIONS.valid_keys()


def test_switch_by_from_pretrained_and_config(tmp_path, monkeypatch):
    model = _build("qwen3_moe", torch.float32)
    model.save_pretrained(tmp_path)
    ids, _ = _inputs(model)
    counter = CallCounter(monkeypatch)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="compiled_moe")
    assert loaded.config._experts_implementation == "compiled_moe"
    with torch.no_grad():
        out = loaded(input_ids=ids).logits
        ref = model(input_ids=ids).logits  # built with "eager"
    assert counter.calls == 2
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    config = CONFIGS["qwen3_moe"]()
    config._experts_implementation = "compiled_moe"
    from_config = AutoModelForCausalLM.from_config(config)
    assert from_config.config._experts_implementation == "compiled_moe"
    kw_config = type(config)(experts_implementation="compiled_moe")
    assert kw_config._experts_implementation == "compiled_moe"
    from transformers import AutoConfig
    auto_config = AutoConfig.from_pretrained(tmp_path, experts_implementation="compiled_moe")
    assert auto_config._experts_implementation == "compiled_moe"
    assert AutoModelForCausalLM.from_config(auto_config).config._experts_implementation == (
        "compiled_moe")


def test_import_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import compiled_moe\n"
            "try:\n    import compiled_moe.integrations.transformers\n"
            "except ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ok", out.stderr


# ------------------------------------------------------------------------------------------
# Standalone experts modules: every flag of use_experts_implementation vs "batched_mm"
# ------------------------------------------------------------------------------------------

E, HS, INTER = 6, 32, 16


def _gpt_oss_stacked_gate(self, gate_up):
    # MiniMax-M3's gate: GPT-OSS's with stacked halves and swiglu_* constants.
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


def _clamped_swiglu_gate(self, gate_up):
    # GLM-5-Next's gate: no named activation has it, so the module's own runs.
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=self.swiglu_limit)
    up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
    return nn.functional.silu(gate) * up


def _fp32_swiglu_gate(self, gate_up):
    # Beam's gate: SwiGLU computed in fp32, which the named activation does too.
    gate, up = gate_up.chunk(2, dim=-1)
    return (self.act_fn(gate.float()) * up.float()).to(gate.dtype)


class _RowNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight


def _standalone(*, has_gate=True, has_bias=False, is_transposed=False, act="silu", gate=None,
                post_norm=False, attrs=None, dtype=torch.float64, device="cpu", seed=0):
    flags = dict(has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed)
    if post_norm:
        flags["has_post_expert_norm"] = True

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            self.num_experts = E
            n1 = 2 * INTER if has_gate else INTER
            fc1 = (E, HS, n1) if is_transposed else (E, n1, HS)
            fc2 = (E, INTER, HS) if is_transposed else (E, HS, INTER)
            w1 = torch.randn(fc1, generator=g) * 3 / HS ** 0.5
            w2 = torch.randn(fc2, generator=g) / INTER ** 0.5
            setattr(self, "gate_up_proj" if has_gate else "up_proj", nn.Parameter(w1))
            self.down_proj = nn.Parameter(w2)
            if has_bias:
                setattr(self, "gate_up_proj_bias" if has_gate else "up_proj_bias",
                        nn.Parameter(torch.randn(E, n1, generator=g) * 0.5))
                self.down_proj_bias = nn.Parameter(torch.randn(E, HS, generator=g) * 0.5)
            if post_norm:
                self.post_expert_norm = _RowNorm(HS)
            self.act_fn = ACT2FN[act]
            for k, v in (attrs or {}).items():
                setattr(self, k, v)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("eager path not under test here")

    if gate is not None:
        Experts._apply_gate = gate
    config = PretrainedConfig()
    config._experts_implementation = "batched_mm"
    return use_experts_implementation(Experts, **flags)(config).to(device=device, dtype=dtype)


def _routing(tokens, k, device="cpu", dtype=torch.float64, seed=1, sentinels=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    hidden = torch.randn(tokens, HS, generator=g)
    if sentinels:  # expert parallelism: pairs routed to other ranks carry id E and weight 0
        drop = torch.rand(tokens, k, generator=g) < 0.3
        ids = torch.where(drop, E, ids)
        weights = torch.where(drop, 0.0, weights)
    return hidden.to(device, dtype), ids.to(device), weights.to(device, dtype)


def _run_module(module, impl, hidden, ids, weights, cot, call=None):
    module.config._experts_implementation = impl
    module.zero_grad(set_to_none=True)
    h = hidden.detach().requires_grad_(True)
    w = weights.detach().requires_grad_(True)
    out = (call if call is not None else module)(h, ids, w)
    (out * cot.to(out.dtype)).sum().backward()
    res = {"out": out.detach(), "hidden": h.grad, "weights": w.grad}
    res.update({n: p.grad for n, p in module.named_parameters()})
    return res


STANDALONE_CASES = {
    # name: (module kwargs, expected (activation, layout, alpha, limit) or None for own)
    "swiglu": (dict(), ("swiglu", "stacked")),
    "swiglu_transposed_bias": (dict(is_transposed=True, has_bias=True), ("swiglu", "stacked")),
    "geglu": (dict(act="gelu_pytorch_tanh"), ("geglu", "stacked")),
    "geglu_python_tanh": (dict(act="gelu_new"), ("geglu", "stacked")),
    "gated_erf_gelu": (dict(act="gelu"), None),
    "gpt_oss_stacked": (dict(gate=_gpt_oss_stacked_gate, has_bias=True, is_transposed=True,
                             attrs=dict(swiglu_alpha=1.5, swiglu_limit=1.0)),
                        ("gpt_oss", "stacked", 1.5, 1.0)),
    "clamped_swiglu": (dict(gate=_clamped_swiglu_gate, attrs=dict(swiglu_limit=1.0)), None),
    "fp32_swiglu": (dict(gate=_fp32_swiglu_gate), ("swiglu", "stacked")),
    "relu2": (dict(has_gate=False, act="relu2"), ("relu2", "stacked")),
    "gelu": (dict(has_gate=False, act="gelu", has_bias=True), ("gelu", "stacked")),
    "silu_transposed": (dict(has_gate=False, act="silu", is_transposed=True), ("silu", "stacked")),
    "tanh_gelu_not_gated": (dict(has_gate=False, act="gelu_pytorch_tanh"), None),
    "post_norm": (dict(post_norm=True), ("swiglu", "stacked")),
}


@pytest.mark.parametrize("case", list(STANDALONE_CASES))
def test_standalone_experts_match_batched_mm(case):
    kwargs, expected = STANDALONE_CASES[case]
    if kwargs.get("post_norm") and not HAS_POST_NORM:
        pytest.skip("this transformers has no post-expert norm")
    module = _standalone(**kwargs)
    spec = backend.resolve_activation(module)
    if expected is None:
        assert spec[0] is None
    else:
        assert spec[:len(expected)] == expected
    hidden, ids, weights = _routing(40, 3)
    cot = torch.randn(40, HS, dtype=torch.float64)
    ref = _run_module(module, "batched_mm", hidden, ids, weights, cot)
    ours = _run_module(module, "compiled_moe", hidden, ids, weights, cot)
    assert ours.keys() == ref.keys()
    # The fp32 gate differs from the (float64) named activation by fp32 rounding, by design.
    tol = 1e-5 if case == "fp32_swiglu" else 1e-10
    for key in ref:
        torch.testing.assert_close(ours[key], ref[key], rtol=tol, atol=tol, msg=key)


def test_standalone_expert_parallel_sentinels():
    module = _standalone(has_bias=True)
    hidden, ids, weights = _routing(40, 3, sentinels=True)
    assert (ids == E).any()
    cot = torch.randn(40, HS, dtype=torch.float64)
    # transformers masks sentinel slots only when the module is marked expert-parallel.
    module._is_expert_parallel = True
    ref = _run_module(module, "batched_mm", hidden, ids, weights, cot)
    ours = _run_module(module, "compiled_moe", hidden, ids, weights, cot)
    for key in ("out", "hidden", "gate_up_proj", "down_proj", "gate_up_proj_bias",
                "down_proj_bias"):
        torch.testing.assert_close(ours[key], ref[key], rtol=1e-10, atol=1e-10, msg=key)
    # a dropped pair's routing weight has no influence on the output
    assert (ours["weights"][ids == E] == 0).all()


def test_standalone_mixed_dtypes():
    # fp32 activations into fp64 weights (as under autocast): computed in the weights' dtype,
    # returned in the activations' dtype, like transformers' grouped_mm backend.
    module = _standalone(has_bias=True)
    hidden, ids, weights = _routing(16, 2)
    module.config._experts_implementation = "compiled_moe"
    out = module(hidden.float(), ids, weights.float())
    assert out.dtype == torch.float32
    module.config._experts_implementation = "batched_mm"
    ref = module(hidden, ids, weights)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


def test_standalone_compile_fullgraph():
    module = _standalone(gate=_clamped_swiglu_gate, attrs=dict(swiglu_limit=1.0), has_bias=True,
                         dtype=torch.float32)
    hidden, ids, weights = _routing(24, 2, dtype=torch.float32)
    module.config._experts_implementation = "compiled_moe"
    eager = module(hidden, ids, weights)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(hidden, ids, weights), eager)
    # and before the activation was recognised: the module's own gate serves while tracing
    torch._dynamo.reset()
    fresh = _standalone(dtype=torch.float32)
    fresh.config._experts_implementation = "compiled_moe"
    compiled = torch.compile(fresh, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(hidden, ids, weights), fresh(hidden, ids, weights))


def test_generate_compiled_decoding_step():
    """A decoding model's whole step compiles into one graph with this backend (a static
    cache, model.forward under torch.compile(fullgraph=True)): what takes the model's own
    Python off the host, where eager generate() spends most of a step. Same tokens as eager."""
    from torch._dynamo.utils import counters
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=128, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.set_experts_implementation("compiled_moe")
    prompt = torch.randint(0, cfg.vocab_size, (2, 6))
    kwargs = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    eager = model.generate(prompt, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    compiled = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(compiled, eager)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 2  # the prompt's step and the decoding step


# ------------------------------------------------------------------------------------------
# GPU tier: bf16 on CUDA against an fp32 eager run
# ------------------------------------------------------------------------------------------

def _pin_routing(model, seed=0):
    """Make every experts module use a fixed random expert choice per token (the router's
    weights still flow). bf16 rounds the router's logits differently from fp32 and flips the
    choice of near-tied tokens, which would swamp the rounding error under test."""
    for i, m in enumerate(_experts_modules(model)):
        g = torch.Generator().manual_seed(seed + i)

        def hook(module, args, g=g, table={}):
            hidden, ids, weights = args
            if ids.shape not in table:
                n_exp = module.gate_up_proj.shape[0]
                table[ids.shape] = torch.stack(
                    [torch.randperm(n_exp, generator=g)[:ids.shape[1]] for _ in range(ids.shape[0])])
            return hidden, table[ids.shape].to(ids.device, ids.dtype), weights

        m.register_forward_pre_hook(hook)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CONFIGS))
def test_gpu_models_bf16(name):
    model32 = _build(name, torch.float32, device="cuda")
    _pin_routing(model32)
    ids, cot = _inputs(model32, device="cuda", batch=4, seq=64)
    ref = _run(model32, ids, cot, "eager")
    model16 = copy.deepcopy(model32).to(torch.bfloat16)
    eager = _run(model16, ids, cot, "eager")
    ours = _run(model16, ids, cot, "compiled_moe")
    # In bf16 single elements are noise-dominated (the routers' gradients lose 10-30% to
    # cancellation in every backend and feed it back into earlier layers): compare whole
    # tensors by their relative norm error.
    keys = ["logits", "inputs_embeds", *sorted(_expert_param_names(model16))]
    _check_design_rule(ours, eager, ref, torch.finfo(torch.bfloat16).eps / 4, name, keys=keys,
                       relative_norm=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["swiglu_transposed_bias", "gpt_oss_stacked", "relu2",
                                  "clamped_swiglu"])
def test_gpu_standalone_no_sync(case):
    kwargs, _ = STANDALONE_CASES[case]
    module = _standalone(**kwargs, dtype=torch.bfloat16, device="cuda")
    hidden, ids, weights = _routing(512, 4, device="cuda", dtype=torch.bfloat16)
    module.config._experts_implementation = "compiled_moe"
    module(hidden, ids, weights)  # the first call also runs the triton autotuner/compiler
    backend.reset_activation_cache(module)  # recognition itself must not sync either
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = module(hidden.requires_grad_(True), ids, weights)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_routing():
    module = _standalone(has_bias=True, is_transposed=True, dtype=torch.bfloat16, device="cuda")
    module.config._experts_implementation = "compiled_moe"
    static = list(_routing(256, 4, device="cuda", dtype=torch.bfloat16))
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernel compilation, activation recognition
            for _ in range(2):
                module(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = module(*static)
        fresh = _routing(256, 4, device="cuda", dtype=torch.bfloat16, seed=7)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        ref = module(*fresh)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_gpu_compiled_model(name):
    # fp32 (IEEE GEMMs): bf16 would let the compiled and eager runs round the router's input
    # differently and pick different experts for a near-tied token.
    model = _build(name, torch.float32, device="cuda")
    ids, _ = _inputs(model, device="cuda", batch=2, seq=32)
    model.set_experts_implementation("compiled_moe")
    with torch.no_grad():
        eager = model(input_ids=ids).logits
        compiled = torch.compile(model)(input_ids=ids).logits
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_compiled_experts_bf16():
    module = _standalone(gate=_gpt_oss_stacked_gate, has_bias=True, is_transposed=True,
                         attrs=dict(swiglu_alpha=1.5, swiglu_limit=1.0), dtype=torch.bfloat16,
                         device="cuda")
    module.config._experts_implementation = "compiled_moe"
    hidden, ids, weights = _routing(256, 4, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn(256, HS, device="cuda", dtype=torch.float64)
    eager = _run_module(module, "compiled_moe", hidden, ids, weights, cot)
    compiled = _run_module(module, "compiled_moe", hidden, ids, weights, cot,
                           call=torch.compile(module, fullgraph=True))
    for key in eager:
        torch.testing.assert_close(compiled[key].float(), eager[key].float(), rtol=2e-2,
                                   atol=2e-2 * eager[key].abs().max().item(), msg=key)
