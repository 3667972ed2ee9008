"""Model state that changes while serving: weight updates (staged, checked, swapped in
between two steps), weight versions, and memory released and resumed by tag."""
