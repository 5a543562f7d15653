"""FX passes of specfx: one pass per file, each `GraphModule -> PassResult`.

See `README.md` in this folder for the invariants every pass keeps. `REGISTRY` maps each pass
name to its class; `specfx passes` lists them.
"""

from specfx.passes.attach_early_exit import AttachEarlyExit, check_exit_layer
from specfx.passes.check_no_host_sync import CheckNoHostSync, find_host_syncs
from specfx.passes.cut_at_exit import CutAtExit
from specfx.passes.drop_head import DropHead
from specfx.passes.expose_hidden import ExposeHidden
from specfx.passes.find_structure import FindStructure, StructureError, StructureMap, find_structure
from specfx.passes.infra import (REGISTRY, Pass, PassError, PassManager, PassOrderError, PassRecord, PassResult,
                                 structure_of)
from specfx.passes.inline_graph_calls import InlineGraphCalls
from specfx.passes.share_kv_buffers import ShareKVBuffers
from specfx.passes.share_rotary import ShareRotary
from specfx.passes.skinny_matmul import Choice, SkinnyMatmul
from specfx.passes.store_draft_weights import StoreDraftWeights
from specfx.passes.tree_attention import TreeAttention
from specfx.passes.truncate_at_exit import TruncateAtExit

__all__ = [
    "AttachEarlyExit", "CheckNoHostSync", "Choice", "CutAtExit", "DropHead", "ExposeHidden", "FindStructure",
    "InlineGraphCalls", "Pass", "PassError", "PassManager", "PassOrderError", "PassRecord", "PassResult", "REGISTRY",
    "ShareKVBuffers", "ShareRotary", "SkinnyMatmul", "StoreDraftWeights", "StructureError", "StructureMap", "TreeAttention", "TruncateAtExit",
    "check_exit_layer",
    "find_host_syncs", "find_structure", "structure_of",
]
