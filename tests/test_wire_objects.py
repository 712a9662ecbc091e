"""Nothing sparsecomm sends between ranks is a pickled Python object: torch.distributed's object
collectives unpickle whatever a peer sends, so no module may call them."""

from pathlib import Path

import sparsecomm

OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                      "send_object_list", "recv_object_list")


def test_no_module_sends_python_objects_between_ranks():
    root = Path(sparsecomm.__file__).parent
    found = [f"{path.relative_to(root)}: {name}" for path in sorted(root.rglob("*.py"))
             for name in OBJECT_COLLECTIVES if name in path.read_text()]
    assert not found, found
