"""fp4lab eval: an NVFP4 checkpoint's model computing from its stored codes and scales."""

import json

import pytest
import torch
from safetensors.torch import save_file

from fp4lab.cli import main
from fp4lab.formats import quantize_nvfp4, scaled_mm
from fp4lab.hub import quantize_model_dir, read_checkpoint
from fp4lab.hub.evaluate import StoredNVFP4Linear, evaluate, load_emulated

from .test_transformers import MODELS

TEXT = " ".join(["the quick brown fox jumps over the lazy dog and then it sleeps under a tree"] * 60)


def test_stored_linear_is_the_reference_fp4_gemm():
    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(48, 64, generator=g), torch.randn(2, 5, 64, generator=g) * 3, torch.randn(48, generator=g)
    qw = quantize_nvfp4(w)
    # W4A16: x in FP32 against the stored block values, one multiply by S_dec
    y = StoredNVFP4Linear(qw, b)(x)
    expected = (x.reshape(-1, 64) @ (torch.nan_to_num(qw.scales.float()).repeat_interleave(16, 1)
                                     * _codes(qw)).T) * qw.tensor_scale + b
    assert torch.allclose(y.reshape(-1, 48), expected, rtol=1e-6, atol=1e-6)
    # W4A4 with a ModelOpt-style stored S_dec_a: the engines' arithmetic, by a scalar oracle
    # S_dec_a where 2688 / (S_dec_a * 2688), the encode scale an amax would give, is 1 ulp off
    # fp32(1 / S_dec_a); a block of amax b then lands on the E4M3 tie 1.0625 with one and not the other
    s_dec_a = torch.tensor(0.0023945935536175966)
    g = torch.reciprocal(s_dec_a)
    xa = x.reshape(-1, 64) / 3
    xa[0, :16] *= 0.015265533700585365 / float(xa[0, :16].abs().max())
    y4 = StoredNVFP4Linear(qw, None, input_encode=g, input_decode=s_dec_a)(xa).reshape(-1, 48)
    xq = torch.tensor([[v for k0 in range(0, 64, 16) for v in _oracle_block(row[k0:k0 + 16].tolist(), g)]
                       for row in xa])
    wv = torch.nan_to_num(qw.scales.float()).repeat_interleave(16, 1) * _codes(qw)
    expected4 = (xq @ wv.T) * (qw.tensor_scale * s_dec_a)
    assert torch.allclose(y4, expected4, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="both"):
        StoredNVFP4Linear(qw, None, input_encode=g)
    with pytest.raises(ValueError, match="2-D NVFP4"):
        StoredNVFP4Linear(quantize_nvfp4(torch.randn(2, 4, 32)), None)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _f32(v):
    return float(torch.tensor(float(v), dtype=torch.float32))


def _oracle_block(xs, g):
    """One block of 16 activations as an engine quantizes it with encode multiplier g: block scale
    e4m3(amax * (g * fp32(1/6))), element scale 1 / (scale * fp32(1 / g)), E2M1 to nearest, ties
    to the even code; -> the dequantized block values (code * block scale)."""
    g = _f32(g)
    mult = _f32(g * _f32(1 / 6))
    sb = float(torch.tensor(min(_f32(max(abs(v) for v in xs) * mult), 448.0)).to(torch.float8_e4m3fn).float())
    if sb == 0:
        return [0.0] * 16
    e = _f32(1.0 / _f32(sb * _f32(1.0 / g)))
    out = []
    for v in xs:
        a = min(abs(_f32(v * e)), 6.0)
        best = min(range(8), key=lambda i: (abs(E2M1[i] - a), i % 2))  # ties: the even code
        out.append((E2M1[best] if v >= 0 else -E2M1[best]) * sb)
    return out


def _codes(q):
    from fp4lab.formats import decode_e2m1
    lo, hi = q.codes & 0xF, q.codes >> 4
    return decode_e2m1(torch.stack([lo, hi], -1).reshape(q.codes.shape[0], -1))


def _model_dir(tmp_path, arch="llama"):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[arch]())
    model.save_pretrained(tmp_path / "hf")
    words = sorted(set(TEXT.split()))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i + 1 for i, w in enumerate(words)} | {"[UNK]": 0},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", transformers


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_emulated_logits_match_the_dequantized_model_to_summation_order(tmp_path, arch):
    hf, transformers = _model_dir(tmp_path, arch)
    quantize_model_dir(hf, tmp_path / "nv", layout="compressed-tensors")
    ckpt = read_checkpoint(tmp_path / "nv")
    model, counts = load_emulated(ckpt, tmp_path / "nv")
    experts = sum(".experts." in m for m in ckpt.weights)
    assert counts == {"emulated_linears": len(ckpt.weights) - experts, "dequantized_weights": experts}
    # the reference: the same weights dequantized (code * s_b * S_dec in FP32), a plain FP32 model
    (tmp_path / "deq").mkdir()
    from fp4lab.formats import dequantize
    save_file({**ckpt.dense, **{f"{m}.weight": dequantize(q).reshape(q.shape) for m, q in ckpt.weights.items()}},
              str(tmp_path / "deq" / "model.safetensors"))
    (tmp_path / "deq" / "config.json").write_text(json.dumps(ckpt.config))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, want = model(tokens).logits, ref(tokens).logits
    # the same products, summed in another order ((x @ v^T) * S_dec vs x @ (v * S_dec)^T)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.equal(got, ref(tokens).logits * 0)  # not trivially zero


def test_eval_against_the_reference_reports_gap_agreement_and_layer_errors(tmp_path, capsys):
    hf, _ = _model_dir(tmp_path)
    quantize_model_dir(hf, tmp_path / "nv")
    r = evaluate(tmp_path / "nv", TEXT, reference=hf, seq_len=64, max_windows=3)
    assert r["tokens"] == 3 * 64 and r["windows"] == 3 and r["emulated_linears"] == 14
    assert r["perplexity"] > 1 and abs(r["nll"] - r["reference_nll"]) < 0.2 and r["top1_agreement"] > 0.6
    ckpt = read_checkpoint(tmp_path / "nv")
    assert set(r["layer_error"]) == set(ckpt.weights)
    assert all(0.02 < e < 0.3 for e in r["layer_error"].values())  # NVFP4's error, one layer at a time
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(["eval", str(tmp_path / "nv"), "--text", str(text), "--reference", str(hf), "--seq-len", "64",
                 "--max-windows", "2", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| emulated FP4 |" in out and "| reference |" in out and "top-1 agreement" in out
    assert (tmp_path / "out" / "layer_error.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["windows"] == 2


def test_eval_refuses_what_it_cannot_score(tmp_path, capsys):
    hf, _ = _model_dir(tmp_path)
    quantize_model_dir(hf, tmp_path / "nv")
    with pytest.raises(ValueError, match="fewer than one window"):
        evaluate(tmp_path / "nv", "the fox", seq_len=64)
    assert main(["eval", str(tmp_path / "nv"), "--text", str(tmp_path / "absent.txt")]) != 0
    assert "no such text file" in capsys.readouterr().err


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_w4a4_ptq_calibrates_activation_scales_and_eval_quantizes_inputs(tmp_path, layout):
    hf, transformers = _model_dir(tmp_path)
    quantize_model_dir(hf, tmp_path / "w4a16", layout=layout)
    quantize_model_dir(hf, tmp_path / "w4a4", layout=layout, calibration=TEXT, seq_len=64, max_windows=2)
    from fp4lab.verify.checkpoint import check_checkpoint
    assert check_checkpoint(tmp_path / "w4a4") == []
    ckpt = read_checkpoint(tmp_path / "w4a4")
    assert ckpt.w4a4 and set(ckpt.input_scales) == set(ckpt.weights)
    config = json.loads((tmp_path / "w4a4" / "config.json").read_text())["quantization_config"]
    if layout == "modelopt":
        assert config["quant_algo"] == "NVFP4"
    else:
        assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    # the activation scale is the largest input the layer saw on the calibration windows / (6 * 448)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    tokens = transformers.AutoTokenizer.from_pretrained(str(hf))(TEXT)["input_ids"][:128]
    seen = {}
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.register_forward_hook(lambda m, a, y: seen.setdefault("x", []).append(a[0].abs().max()))
    with torch.no_grad():
        model(torch.tensor(tokens[:64])[None]), model(torch.tensor(tokens[64:])[None])
    expected = max(seen["x"]) / (6 * 448)
    assert torch.allclose(ckpt.input_decode("model.layers.1.self_attn.o_proj"), expected, rtol=1e-6)
    a4 = evaluate(tmp_path / "w4a4", TEXT, reference=hf, seq_len=64, max_windows=2)
    a16 = evaluate(tmp_path / "w4a16", TEXT, reference=hf, seq_len=64, max_windows=2)
    assert a4["w4a4"] and not a16["w4a4"]
    # quantizing the inputs too adds error in every layer
    assert all(a4["layer_error"][m] > a16["layer_error"][m] for m in a16["layer_error"])


def test_quantize_with_a_calibration_text_writes_w4a4_through_the_cli(tmp_path, capsys):
    hf, _ = _model_dir(tmp_path)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    assert main(["quantize", str(hf), str(tmp_path / "nv"), "--calibration", str(text)]) == 0
    assert "W4A4 NVFP4, activation scales calibrated" in capsys.readouterr().out
    ckpt = read_checkpoint(tmp_path / "nv")
    assert ckpt.w4a4 and set(ckpt.input_scales) == set(ckpt.weights)
    assert main(["quantize", str(hf), str(tmp_path / "nv2"), "--calibration", str(tmp_path / "absent.txt")]) == 2
    assert "no such calibration text" in capsys.readouterr().err and not (tmp_path / "nv2").exists()
