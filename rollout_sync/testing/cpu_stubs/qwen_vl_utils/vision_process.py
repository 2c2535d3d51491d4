"""FAKE-PACKAGE: ``qwen_vl_utils.vision_process`` stand-in; every function raises."""

from __future__ import annotations

from typing import Any


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
        "qwen_vl_utils is a CPU stand-in here (the real one needs torchvision, which has no "
        "CPU build for this torch)"
    )


process_vision_info = _unavailable
fetch_image = _unavailable
fetch_video = _unavailable
