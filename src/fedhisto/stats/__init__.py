"""The package's statistics: metrics, the prediction-CSV format, paired and cluster bootstrap resampling,
temperature scaling and the experiments' interval estimates."""
