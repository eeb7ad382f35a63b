"""What an SGLang engine refuses before its server loads a folder
(``engines.sglang.folder_check``): SGLang 0.5.17 itself loads whatever tensors a
folder holds and answers success."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from engines.sglang.folder_check import refusal, start_shapes


def _folder(path, tensors) -> str:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_a_folder_short_of_a_tensor_or_reshaped_or_unreadable_is_refused(tmp_path):
    full = {"a.weight": torch.zeros(2, 3), "b.weight": torch.zeros(4)}
    start = start_shapes(_folder(tmp_path / "start", full))
    # Another dtype is fine: a trainer may publish fp32 of a bf16 start.
    same = {k: v.to(torch.bfloat16) for k, v in full.items()}
    assert refusal(_folder(tmp_path / "same", same), start) is None
    short = refusal(_folder(tmp_path / "short", {"a.weight": torch.zeros(2, 3)}), start)
    assert "missing 1 tensor(s), e.g. ['b.weight']" in short
    reshaped = refusal(_folder(tmp_path / "reshaped", {**full, "b.weight": torch.zeros(5)}), start)
    assert "b.weight (5,) != (4,)" in reshaped
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert "unreadable safetensors header" in refusal(str(cut), start)
    assert "no such file" in refusal(str(tmp_path / "absent"), start).lower()


def test_a_start_folder_without_safetensors_leaves_reloads_to_the_server(tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    assert start_shapes(str(tmp_path / "bin")) is None
    assert refusal(str(tmp_path / "anything"), None) is None
