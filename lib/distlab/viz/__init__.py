"""Pictures of the course, drawn with matplotlib from real runs. One module per topic."""
