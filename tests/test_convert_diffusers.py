"""DiT <-> diffusers DiTTransformer2DModel: key mapping, forward equality against the peer implementation, folders.

The peer is built offline from a tiny config. It differs from official DiT math in two documented places
(timestep frequencies i/(half-1) instead of i/half; MLP LayerNorm eps = norm_eps, default 1e-5, instead of
1e-6), so the equality test sets the peer to DiT's math; test_stock_diffusers_differs_only_in_timestep_frequencies
pins down that those are the only differences.
"""
import json

import pytest
import torch
from diffusers import DiTTransformer2DModel
from diffusers.models.embeddings import get_timestep_embedding

from opendit.checkpoint import load_weights
from opendit.families import get_family
from opendit.models import layers
from opendit.families.dit.weights import DIT_WEIGHTS
from opendit.families.dit.model import DiT

# fp32 on both sides; the same ops in the same order give (here) identical results, 1e-5 leaves room for an
# attention backend that sums in another order. The outputs are O(1) (adaLN and final layer re-initialised).
ATOL = 1e-5


def ours_model(seed: int = 0) -> DiT:
    """Tiny DiT with random non-zero adaLN and final layers (DiT's zero init would make every block the
    identity and the output zero, hiding any mapping error there)."""
    torch.manual_seed(seed)
    model = DiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4, num_classes=10,
                learn_sigma=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "adaLN" in name or "final_layer" in name:
                p.normal_(0, 0.05)
    return model.eval()


def peer_model(dit_math: bool = True) -> DiTTransformer2DModel:
    """diffusers' DiT with the same dims; dit_math=True sets its two deviations from the official DiT back."""
    model = DiTTransformer2DModel(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=8,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
                                  norm_type="ada_norm_zero", norm_eps=1e-6 if dit_math else 1e-5)
    if dit_math:
        for block in model.transformer_blocks:
            block.norm1.emb.time_proj.downscale_freq_shift = 0
    return model.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([0.0, 17.0, 999.0])
    y = torch.tensor([1, 10, 7])  # 10 is the null (CFG) class: the extra table row must map too
    return x, t, y


@torch.no_grad()
def test_converted_weights_give_the_same_output_as_diffusers():
    ours = ours_model()
    peer = peer_model()
    peer.load_state_dict(DIT_WEIGHTS.to_diffusers(ours.state_dict(), depth=2), strict=True)
    x, t, y = inputs()
    expected = ours(x, t, y)
    got = peer(x, t, y).sample
    assert expected.abs().max() > 0.1  # a zero output would match anything
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)


@torch.no_grad()
def test_stock_diffusers_differs_only_in_timestep_frequencies(monkeypatch):
    ours, peer = ours_model(), peer_model(dit_math=False)
    peer.load_state_dict(DIT_WEIGHTS.to_diffusers(ours.state_dict()), strict=True)
    x, t, y = inputs()
    gap = (peer(x, t, y).sample - ours(x, t, y)).abs().max()
    assert gap > 1e-3  # the frequency denominator changes the output visibly
    # With diffusers' frequencies in our model, only the MLP LayerNorm eps (1e-5 vs 1e-6) is left: ~1e-6.
    monkeypatch.setattr(layers, "timestep_embedding", lambda t, dim: get_timestep_embedding(
        t, dim, flip_sin_to_cos=True, downscale_freq_shift=1))
    torch.testing.assert_close(peer(x, t, y).sample, ours(x, t, y), atol=1e-5, rtol=1e-5)


def test_round_trips_are_bitwise():
    for dtype in (torch.float32, torch.bfloat16):
        sd = ours_model().to(dtype).state_dict()
        back = DIT_WEIGHTS.from_diffusers(DIT_WEIGHTS.to_diffusers(sd), {"input_size": 8})
        assert back.keys() == sd.keys()
        assert all(back[k].dtype == dtype and torch.equal(back[k], sd[k]) for k in sd)
    peer_sd = peer_model().state_dict()
    for key in [k for k in peer_sd if ".norm1.emb." in k and k.startswith("transformer_blocks.1.")]:
        peer_sd[key] = peer_sd[key.replace("blocks.1.", "blocks.0.")].clone()  # DiT shares one embedder
    again = DIT_WEIGHTS.to_diffusers(DIT_WEIGHTS.from_diffusers(peer_sd, {"input_size": 8}))
    assert again.keys() == peer_sd.keys() and all(torch.equal(again[k], peer_sd[k]) for k in peer_sd)


def test_unconvertible_weights_are_refused():
    sd = ours_model().state_dict()
    with pytest.raises(ValueError, match="learned position embedding"):
        DIT_WEIGHTS.to_diffusers({**sd, "pos_embed": sd["pos_embed"] + 0.1})
    with pytest.raises(ValueError, match="depth=3"):
        DIT_WEIGHTS.to_diffusers(sd, depth=3)
    with pytest.raises(KeyError, match="'module.' or 'transformer.'"):
        DIT_WEIGHTS.to_diffusers({("module." + k if k.startswith("final") else k): v for k, v in sd.items()})
    theirs = DIT_WEIGHTS.to_diffusers(sd)
    key = "transformer_blocks.1.norm1.emb.timestep_embedder.linear_1.weight"
    with pytest.raises(ValueError, match="differs from block 0"):
        DIT_WEIGHTS.from_diffusers({**theirs, key: theirs[key] + 1}, {"input_size": 8})


@torch.no_grad()
def test_load_weights_reads_model_and_pipeline_folders(tmp_path):
    ours = ours_model()
    peer = peer_model()
    peer.load_state_dict(DIT_WEIGHTS.to_diffusers(ours.state_dict()), strict=True)
    peer.save_pretrained(tmp_path / "pipe" / "transformer")  # config.json + diffusion_pytorch_model.safetensors
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    x, t, y = inputs()
    dit = get_family("dit")  # the family that owns the format reads it; generic checkpoint code does not
    for folder in (tmp_path / "pipe" / "transformer", tmp_path / "pipe"):
        loaded = dit.load_weights(str(folder))
        fresh = ours_model(seed=5)
        fresh.load_state_dict(loaded, strict=True)
        torch.testing.assert_close(fresh(x, t, y), ours(x, t, y), atol=0, rtol=0)
        with pytest.raises(ValueError, match="is a folder but not a checkpoint"):
            load_weights(str(folder))
    kwargs, sd = DIT_WEIGHTS.load_diffusers(tmp_path / "pipe")
    assert kwargs == {"input_size": 8, "patch_size": 2, "in_channels": 4, "hidden_size": 64, "depth": 2,
                      "num_heads": 4, "num_classes": 10, "learn_sigma": True, "mlp_ratio": 4.0}
    DiT(**kwargs).load_state_dict(sd, strict=True)
    settings, _ = dit.recognize_checkpoint(str(tmp_path / "pipe"))
    assert (settings["model"], settings["image_size"], settings["num_classes"]) == ("DiT-debug", 64, 10)


def test_bad_folders_get_clear_errors(tmp_path):
    (tmp_path / "vae").mkdir()
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(ValueError, match="'AutoencoderKL', not a DiTTransformer2DModel"):
        DIT_WEIGHTS.load_diffusers(tmp_path / "vae")
    (tmp_path / "empty").mkdir()
    cfg = dict(peer_model().config)
    (tmp_path / "empty" / "config.json").write_text(json.dumps({**cfg, "_class_name": "DiTTransformer2DModel"}))
    with pytest.raises(FileNotFoundError, match="holds no weights: expected one diffusion_pytorch_model.safetensors"):
        DIT_WEIGHTS.load_diffusers(tmp_path / "empty")
    (tmp_path / "geglu").mkdir()
    (tmp_path / "geglu" / "config.json").write_text(json.dumps({**cfg, "_class_name": "DiTTransformer2DModel",
                                                                 "activation_fn": "geglu"}))
    with pytest.raises(ValueError, match="cannot compute"):
        DIT_WEIGHTS.load_diffusers(tmp_path / "geglu")
    (tmp_path / "pipe_no_transformer").mkdir()
    (tmp_path / "pipe_no_transformer" / "model_index.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="transformer/config.json"):
        get_family("dit").load_weights(str(tmp_path / "pipe_no_transformer"))


@torch.no_grad()
def test_sample_py_loads_a_diffusers_folder(tmp_path):
    """sample.py's loader takes the model name, classes and sigma from the folder's config.json."""
    from opendit.config import SampleConfig
    from opendit.inference import load_model

    ours = ours_model()
    peer = peer_model()
    peer.load_state_dict(DIT_WEIGHTS.to_diffusers(ours.state_dict()), strict=True)
    peer.save_pretrained(tmp_path / "dit")
    # no VAE offline: sample its 8x8 latent space directly (the folder alone implies sd-vae-ft-ema at 64 px)
    cfg = SampleConfig(ckpt=str(tmp_path / "dit"), vae="none", image_size=8, in_channels=4)
    loaded = load_model(cfg, torch.device("cpu"))
    assert loaded.encoders.vae is None and loaded.cfg.model == "DiT-debug" and loaded.cfg.num_classes == 10
    x, t, y = inputs()
    torch.testing.assert_close(loaded.model(x, t, y), ours(x, t, y), atol=0, rtol=0)
