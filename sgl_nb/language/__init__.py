"""The language: the expressions (`gen`, `select`, roles), `@sgl.function` and its runs, and the
interpreter (`ProgramState`, a façade whose `s += ...` records Nodes through its recorder;
its run's data is one `ProgramRun`, which the executor's `ProgramEffects` changes and readers
see as a `ProgramSnapshot`). `sgl_nb` exports the public names."""
