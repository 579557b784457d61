"""What is happening: readings and evidence, returned as facts. Nothing here decides or acts."""
