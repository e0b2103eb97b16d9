"""What the training examples share: the embedded corpus, a progress line, running the reference
and our attention in separate processes, the report and the plot."""
