"""The engine/protocol process layout (`--frontend-processes N`, N >= 2): supervisor, engine, protocol processes."""
