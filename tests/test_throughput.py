"""unison.throughput: nanoGPT's FLOPs per token, the peak table, and the meter's rates and MFU."""

from __future__ import annotations

import time

import pytest
import torch

from unison.commands.main import main
from unison.throughput import PEAK_BF16_FLOPS, Throughput, peak_flops, transformer_flops_per_token


def test_flops_per_token_is_6n_plus_12_l_d_t_as_nanogpt_counts_it():
    # GPT-2 124M at 1024 tokens: nanoGPT's estimate_mfu gives 6 * 124.4M + 12 * 12 * 768 * 1024
    assert transformer_flops_per_token(124_439_808, 12, 768, 1024) == 6 * 124_439_808 + 12 * 12 * 768 * 1024
    with pytest.raises(ValueError, match=r"layers=0: a whole number >= 1"):
        transformer_flops_per_token(10, 0, 8, 8)


def test_peak_is_known_for_data_center_gpus_and_none_on_a_cpu(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert peak_flops(torch.device("cuda", 0)) == PEAK_BF16_FLOPS["H100 PCIe"] == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0)) is None


@pytest.mark.serial
def test_the_meter_divides_what_the_loop_reports_by_the_time_it_took():
    meter = Throughput(flops_per_token=6e6, peak_flops=1e12, devices=2)
    for _ in range(3):
        time.sleep(0.02)
        meter.step(tokens=1000, samples=4)
    rates = meter.compute()
    elapsed = 3000 / rates["tokens_per_s"]
    assert 0.06 <= elapsed < 1.0 and rates["samples_per_s"] * elapsed == pytest.approx(12)
    assert rates["mfu"] == pytest.approx(rates["tokens_per_s"] * 6e6 / 2e12)
    assert "mfu" not in Throughput(flops_per_token=6e6).compute()  # no peak (a CPU): no MFU
    meter.reset()
    assert (meter.tokens, meter.samples, meter.steps) == (0, 0, 0)
    with pytest.raises(ValueError, match=r"devices=0"):
        Throughput(devices=0)


@pytest.mark.serial
def test_paused_time_does_not_count_against_the_rate():
    meter = Throughput()
    meter.step(tokens=100)
    with meter.paused():  # an evaluation or a checkpoint between steps
        time.sleep(0.3)
    assert meter.elapsed < 0.2 and meter.compute()["tokens_per_s"] > 100 / 0.2


def test_a_peak_given_by_the_user_wins_over_the_table_and_is_checked(monkeypatch):
    monkeypatch.delenv("UNISON_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), override=2e12) == 2e12
    assert peak_flops(torch.device("cpu"), override="5e11") == 5e11
    monkeypatch.setenv("UNISON_PEAK_FLOPS", "3e12")  # what `unison launch --peak-flops 3e12` exports
    assert peak_flops(torch.device("cpu")) == 3e12
    assert peak_flops(torch.device("cpu"), override=1e12) == 1e12  # the argument beats the variable
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0)) == 3e12  # and the table (a user knows their clocks)
    monkeypatch.setenv("UNISON_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match=r"UNISON_PEAK_FLOPS='fast' is not a positive number of FLOP/s"):
        peak_flops(torch.device("cpu"))
    for bad in (0, -1e12, float("inf"), float("nan")):
        with pytest.raises(
            ValueError, match=r"peak_flops=.* is not a positive number of FLOP/s: .* e\.g\. 1e12"
        ):
            peak_flops(torch.device("cpu"), override=bad)


def test_launch_refuses_a_peak_that_is_not_a_positive_number(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as stop:
        main(["launch", "--cpu", "--peak-flops", "-5", str(script)])
    assert stop.value.code == 2
    assert "--peak-flops='-5' is not a positive number of FLOP/s: give one device's peak, e.g. 1e12" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main(["launch", "--cpu", "--peak-flops", "many", str(script)])
    assert "--peak-flops='many' is not a positive number of FLOP/s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["launch", "--help"])
    assert "UNISON_PEAK_FLOPS=FLOPS" in capsys.readouterr().out  # among the variables it exports
