"""The notebook part: the `%%sgl` magics (magics.py), a cell compiled into a program
(cell_program.py) and the widgets (widgets/). `%load_ext sgl_nb` loads the magics."""
