"""An OCR service for a onecard unit: RapidOCR's ONNX models (shipped in the
rapidocr-onnxruntime wheel), written with the public API only."""
