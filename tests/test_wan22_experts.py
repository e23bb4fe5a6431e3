"""Wan2.2's two-expert A14B models: the release folders (official high_noise_model/ + low_noise_model/, diffusers
transformer/ + transformer_2/ with boundary_ratio), one expert trained per run from its own folder or both in one
run (--expert both: each micro-batch one expert's, the same on every rank and on resume), and sampling that switches
experts at the boundary with a guidance scale each, the idle one off the device."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

from opendit import config as cfglib
from opendit.checkpoint import read_dcp_weights
from opendit.families.base import LoadedModel
from opendit.families.wan.experts import ExpertPair
from opendit.families.wan.family import Experts, WanFamily, expert_folders
from opendit.families.wan.model import WAN22_CONFIGS, WanModel
from opendit.families.wan.objective import WanEncoders
from opendit.diffusion.flow import shift_times
from tests.run_each import cli, run_here
from tests.test_train import ROOT

MODEL = "Wan2.2-I2V-debug"  # TI2V-sized at CPU scale, I2V's 36 input channels, the I2V release's boundary 0.9


def expert_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = WanModel(**WAN22_CONFIGS[MODEL])
    nn.init.normal_(model.head.head.weight, std=0.05)  # initialised to zeros: every expert would predict 0
    return model.state_dict()


def write_expert(folder, seed: int) -> None:
    """An official-layout expert folder: config.json with the official fields + diffusion_pytorch_model.safetensors."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    state = expert_state(seed)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in WAN22_CONFIGS[MODEL].items()}
    (folder / "config.json").write_text(json.dumps({"_class_name": "WanModel", **config}))


def test_expert_folders_of_both_layouts(tmp_path):
    official = tmp_path / "official"
    (official / "high_noise_model").mkdir(parents=True)
    (official / "low_noise_model").mkdir()
    assert expert_folders(official) == {"high": official / "high_noise_model", "low": official / "low_noise_model",
                                        "boundary": None}
    pipe = tmp_path / "pipe"
    for name in ("transformer", "transformer_2"):
        (pipe / name).mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.875}))
    assert expert_folders(pipe) == {"high": pipe / "transformer", "low": pipe / "transformer_2", "boundary": 0.875}
    assert expert_folders(official / "high_noise_model") is None and expert_folders(tmp_path / "nothing") is None


def test_an_a14b_folder_trains_one_expert_per_run(tmp_path):
    folder = tmp_path / "A14B"
    (folder / "high_noise_model").mkdir(parents=True)
    (folder / "low_noise_model").mkdir()
    base = dict(model="Wan2.2-T2V-A14B", umt5="none", vae="none", init_weights=str(folder))
    with pytest.raises(ValueError, match="holds two experts .*--expert high or --expert low"):
        WanFamily().fill_defaults(cfglib.TrainConfig(**base))
    cfg = WanFamily().fill_defaults(cfglib.TrainConfig(**base, expert="low"))
    assert cfg.init_weights == str(folder / "low_noise_model") and cfg.expert_boundary == 0.875
    both = WanFamily().fill_defaults(cfglib.TrainConfig(**base, expert="both"))
    assert both.init_weights == str(folder) and both.expert_boundary == 0.875
    for flag in ("lora_rank", "blocks_to_swap"):
        with pytest.raises(ValueError, match=f"--expert both with --{flag}: .*--expert high .*--expert low"):
            WanFamily().fill_defaults(cfglib.TrainConfig(**base, expert="both", **{flag: 4}))


def test_both_experts_train_one_per_micro_batch_as_often_as_their_share_of_the_times():
    """Each micro-batch's expert comes from (seed, step, micro-batch) alone, as likely as a training time at or
    above the boundary; its times all fall on its side, and only its parameters get gradients."""
    cfg = WanFamily().fill_defaults(cfglib.TrainConfig(model=MODEL, umt5="none", vae="none", expert="both",
                                                       expert_boundary=0.6))  # shift 1: the release's 0.9 is rare
    objective = WanFamily().objective(cfg, WanEncoders(vae=None, text=None))
    drawn = []
    for step in range(1, 2001):
        objective.begin_step(step)
        drawn += [objective.next_expert(), objective.next_expert()]  # two micro-batches
    objective.begin_step(7)
    assert [objective.next_expert(), objective.next_expert()] == drawn[12:14]  # a resumed step draws the same
    torch.manual_seed(0)
    share = float((shift_times(objective.flow.sample_t(100_000), cfg.flow_shift) >= 0.6).float().mean())
    assert abs(drawn.count("high") / len(drawn) - share) < 0.02 and 0.2 < share < 0.5

    torch.manual_seed(0)
    pair = WanFamily().build_model(cfg, (16, 3, 8, 8))
    assert isinstance(pair, ExpertPair) and pair.boundary == 0.6
    x, cond = torch.randn(2, 16, 3, 8, 8), {"context": torch.randn(2, pair.text_len, pair.text_dim),
                                            "y": torch.randn(2, 20, 3, 8, 8)}
    for step in (1, 2, 3, 4):  # both experts among these steps' draws
        objective.begin_step(step)
        expert = drawn[2 * (step - 1)]
        pair.zero_grad(set_to_none=True)
        losses, t = objective.losses(pair, x, cond)
        losses.mean().backward()
        assert bool((t >= 0.6).all()) if expert == "high" else bool((t < 0.6).all())
        idle = pair.low if expert == "high" else pair.high
        assert all(p.grad is None for p in idle.parameters())
        assert all(p.grad is not None for p in getattr(pair, expert).parameters())
    assert {"high", "low"} <= set(drawn[:8:2])
    pair.eval()  # validation: each sample from its own expert
    t = torch.tensor([950.0, 100.0])
    with torch.no_grad():
        out = pair(x, t, cond["context"], y=cond["y"])
        assert torch.equal(out[0], pair.high(x, t, cond["context"], y=cond["y"])[0])
        assert torch.equal(out[1], pair.low(x, t, cond["context"], y=cond["y"])[1])


class Stub(nn.Module):
    """A model whose moves are recorded (its one parameter is made anew on the device it is moved to)."""

    def __init__(self):
        super().__init__()
        self.weight, self.moves = nn.Parameter(torch.zeros(1)), []

    def to(self, device):
        self.moves.append(str(device))
        self.weight = nn.Parameter(torch.empty(1, device=device))
        return self


def test_experts_switch_at_the_boundary_with_a_scale_each_and_only_the_one_in_use_on_the_device():
    high, low = Stub(), Stub()
    cfg = WanFamily().fill_defaults(cfglib.TrainConfig(model=MODEL, umt5="none", vae="none"))
    loaded = LoadedModel(WanFamily(), high, None, cfg, (1,), "w", companions={"low_noise": low})
    sample_cfg = cfglib.SampleConfig(cfg_scale=4.0, cfg_scale_low=3.0)
    experts = Experts(loaded, sample_cfg, "cpu")
    assert experts.at(0.95) == (high, 4.0) and experts.at(0.9) == (high, 4.0) and experts.at(0.5) == (low, 3.0)
    assert high.moves == low.moves == []  # on the host nothing moves
    meta = Experts(loaded, sample_cfg, "meta")  # a device that is not the host: the idle expert leaves it
    meta.at(0.95)
    meta.at(0.5)
    assert high.moves == ["meta", "cpu"] and low.moves == ["meta"]
    meta.at(0.4)
    meta.at(0.95)
    assert high.moves == ["meta", "cpu", "meta"] and low.moves == ["meta", "cpu"]
    alone = Experts(LoadedModel(WanFamily(), high, None, cfg, (1,), "w"), sample_cfg, "cpu")  # a preview: one
    assert alone.at(0.1) == (high, 4.0)


@pytest.mark.slow
def test_two_experts_train_and_sample_from_the_official_layout(tmp_path):
    """--init_weights A14B --expert low trains a LoRA on the low-noise expert; sample.py --ckpt A14B runs the high
    expert above t = 0.9 and the low one below (the same as naming both folders; not the same as the high expert
    throughout); the LoRA run's checkpoint serves as the low-noise expert."""
    from PIL import Image

    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wan.vae import save_tiny_wan_vae

    umt5 = save_tiny_umt5(tmp_path / "umt5", max_length=16)
    vae = save_tiny_wan_vae(tmp_path / "vae")
    folder = tmp_path / "A14B"
    write_expert(folder / "high_noise_model", 1)
    write_expert(folder / "low_noise_model", 2)
    Image.fromarray((np.random.default_rng(0).random((32, 32)) * 255).astype(np.uint8)).save(tmp_path / "first.png")
    run_here("train.py", "--model", MODEL, "--init_weights", folder, "--expert", "low", "--lora_rank", "4", "--umt5",
        umt5, "--vae", vae, "--dataset", "moving_digits", "--image_size", "32", "--num_frames", "5", "--batch_size",
        "2", "--max_steps", "2", "--lr", "0.05", "--ema_decay", "0", "--num_workers", "0", "--outputs",
        tmp_path / "low")
    trained = next((tmp_path / "low").glob("*/config.yaml")).read_text()
    assert re.search(r"init_weights: .*low_noise_model", trained) and "expert_boundary: 0.9" in trained

    common = ["--umt5", umt5, "--vae", vae, "--model", MODEL, "--prompt", "the digit 3", "--image",
              tmp_path / "first.png", "--image_size", "32", "--num_frames", "5", "--num_sampling_steps", "4", "--npz"]

    def sample(name, *args, here=False):  # here: in this process (a run whose log is not read)
        out = run_here("sample.py", *common, *args, "--out", tmp_path / name) if here else \
            cli("sample.py", *common, *args, "--out", tmp_path / name)
        return np.load(tmp_path / name / "samples.npz")["arr_0"], out and out.stderr

    both, log = sample("both", "--ckpt", folder)
    assert "holds the low_noise model too" in log
    named, _ = sample("named", "--ckpt", folder / "high_noise_model", here=True)  # its sibling: the low expert
    high_only, _ = sample("high", "--ckpt", folder / "high_noise_model", "--low_noise_ckpt",
                          folder / "high_noise_model", here=True)
    assert np.array_equal(both, named) and not np.array_equal(both, high_only)
    # the low expert's LoRA run as the companion: its base (the low expert) and its adapters
    lora, log = sample("lora", "--ckpt", folder / "high_noise_model", "--low_noise_ckpt",
                       next((tmp_path / "low").glob("*/checkpoints/step-000002")))
    assert "low_noise_model as the low_noise model" in log and not np.array_equal(lora, both)
    out = subprocess.run([sys.executable, "sample.py", *map(str, common), "--ckpt", str(folder / "low_noise_model"),
                          "--out", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--low_noise_ckpt the low-noise one's" in out.stderr.splitlines()[-1]

    # --expert both from the folder: its one step trained one expert and left the other as the folder has it
    run_here("train.py", "--model", MODEL, "--init_weights", folder, "--expert", "both", "--umt5", umt5, "--vae", vae,
        "--dataset", "moving_digits", "--image_size", "32", "--num_frames", "5", "--batch_size", "2", "--max_steps",
        "1", "--lr", "0.05", "--ema_decay", "0", "--num_workers", "0", "--outputs", tmp_path / "both")
    step = next((tmp_path / "both").glob("*/checkpoints/step-000001"))
    trained = read_dcp_weights(str(step), "model")
    kept = [side for side, seed in (("high", 1), ("low", 2)) if all(
        torch.equal(trained[f"{side}.{k}"], v) for k, v in expert_state(seed).items())]
    assert len(kept) == 1
    pair, _ = sample("pair", "--ckpt", step, here=True)  # both experts from the run's one checkpoint
    assert pair.shape == both.shape and not np.array_equal(pair, both)


def test_a_diffusers_a14b_pipeline_loads_both_experts_and_its_boundary(tmp_path):
    """transformer/ is the high-noise expert, transformer_2/ the low-noise one, model_index.json's boundary_ratio
    the switch; the folder also names its VAE and UMT5."""
    import shutil

    from diffusers import WanTransformer3DModel

    from opendit.families.wan.tiny_umt5 import save_tiny_umt5
    from opendit.families.wan.vae import save_tiny_wan_vae
    from opendit.families.wan.weights import WAN_WEIGHTS
    from opendit.inference import load_model

    pipe = tmp_path / "pipe"
    states = {"transformer": expert_state(1), "transformer_2": expert_state(2)}
    for name, state in states.items():
        theirs = WanTransformer3DModel(**WAN_WEIGHTS.arch_to_diffusers(WAN22_CONFIGS[MODEL]))
        theirs.load_state_dict(WAN_WEIGHTS.to_diffusers(state), strict=True)
        theirs.save_pretrained(pipe / name)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "boundary_ratio": 0.5}))
    shutil.copytree(save_tiny_wan_vae(tmp_path / "vae"), pipe / "vae")
    save_tiny_umt5(tmp_path / "umt5", pipeline=True)
    for sub in ("text_encoder", "tokenizer"):
        shutil.copytree(tmp_path / "umt5" / sub, pipe / sub)
    loaded = load_model(cfglib.SampleConfig(ckpt=str(pipe), image_size=32, num_frames=5), torch.device("cpu"))
    assert loaded.cfg.model == MODEL and loaded.cfg.expert_boundary == 0.5
    for model, state in ((loaded.model, states["transformer"]), (loaded.companions["low_noise"],
                                                                   states["transformer_2"])):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_the_memory_planner_counts_both_experts_weights_and_one_experts_activations():
    from opendit.plan.measure import model_facts

    facts = {}
    for expert in ("high", "both"):
        cfg = WanFamily().fill_defaults(cfglib.TrainConfig(model=MODEL, umt5="none", vae="none", expert=expert,
                                                           image_size=16, num_frames=3))
        shape = WanFamily().memory_probe(cfg, torch.device("meta")).latent_shape
        facts[expert] = model_facts(WanFamily(), cfg, shape, torch.float32)
    one, both = facts["high"], facts["both"]
    assert both.trainable == 2 * one.trainable and both.blocks == one.blocks * 2
    assert both.root_acts == one.root_acts and both.acts[:len(one.acts)] == one.acts
    assert all(a.kept == a.inputs == 0 for a in both.acts[len(one.acts):])  # the idle expert saves nothing
