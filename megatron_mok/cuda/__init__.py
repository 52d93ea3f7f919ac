"""The CUDA backend's Python side: the compiled library (:mod:`.library`), peer memory
(:mod:`.peer_memory`), the workspace layout (:mod:`.workspace`) and the backend (:mod:`.backend`)."""
