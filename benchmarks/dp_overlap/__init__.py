"""How much of the data-parallel gradient reduction hides behind backward (see __main__)."""
