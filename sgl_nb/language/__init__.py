"""The language: the expressions (`gen`, `select`, roles), `@sgl.function` and its runs, and the
interpreter (`ProgramState`, whose `s += ...` records Nodes and whose effects the executor
runs). `sgl_nb` exports the public names."""
