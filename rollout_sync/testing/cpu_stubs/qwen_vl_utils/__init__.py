"""FAKE-PACKAGE: a stand-in for ``qwen_vl_utils``, which has no CPU build here (see ../README.md).

``import cosmos_rl`` imports it at top level; calling anything in it raises.
"""

from .vision_process import fetch_image, fetch_video, process_vision_info

__all__ = ["fetch_image", "fetch_video", "process_vision_info"]
