"""The structure of a graph the search and the story read: repeated layers and Megatron patterns."""
