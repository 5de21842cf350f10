"""Client and evaluation images as arrays, and the study's training views and evaluation transform."""
