"""Data: JSON lines -> validated, tokenized, packed training rows (never touches the model).

``reader``      JSON lines, ``file:line`` errors, train/dev split discovery
``tokenize``    chat templates, src/tgt -> input ids + labels, truncation counts
``binpack``     which examples share a row (in order, best-fit-decreasing per group)
``packed_row``  one pack -> a row with restarting position ids and FlashMask start rows
``packing``     PackedDataset (shuffled packs per epoch) and its stats
``streaming``   lazy=true: group-at-a-time packing with a resumable cursor
``collate``     batch padding and packed collators
``pipeline``    the run's datasets and data reports, from a RunConfig
"""
