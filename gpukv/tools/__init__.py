"""Commands for people: `gpukv demo`, `bench`, `calibrate` and `info`."""
