"""Tiny CNN / ViT / encoder models from transformers configs, for the casts-versus-autocast comparison.

Each builder returns (model, kwargs of one batch); the model returns `.logits`.
"""

from __future__ import annotations

import torch
import transformers as tf

IMAGE = 32


def _pixels(channels=3, size=IMAGE):
    return {"pixel_values": torch.randn(2, channels, size, size)}


def _tokens(vocab=128):
    return {"input_ids": torch.randint(0, vocab, (2, 16)), "attention_mask": torch.ones(2, 16, dtype=torch.long)}


def convnext():
    config = tf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=4, image_size=IMAGE)
    return tf.ConvNextForImageClassification(config), _pixels()


def swin():
    config = tf.SwinConfig(image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                           window_size=4, num_labels=4)
    return tf.SwinForImageClassification(config), _pixels()


def segformer():
    config = tf.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                                num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2],
                                mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=4)
    return tf.SegformerForImageClassification(config), _pixels()


def mobilevit():
    config = tf.MobileViTConfig(image_size=IMAGE, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
                                num_attention_heads=2, num_labels=4)
    return tf.MobileViTForImageClassification(config), _pixels()


def shallow_mobilevit():
    """mobilevit() with one block in each stage where HF builds more whatever the config (3 MobileNet blocks in the
    second stage, 2, 4 and 3 transformer layers in the MobileViT stages): the same convolutions beside attention,
    in each stage, with a third of the ops to trace."""
    model, batch = mobilevit()
    encoder = model.mobilevit.encoder
    encoder.layer[1].layer = encoder.layer[1].layer[:1]
    for stage in encoder.layer[2:]:
        stage.transformer.layer = stage.transformer.layer[:1]
    return model, batch


def albert():
    config = tf.AlbertConfig(vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128, num_labels=4)
    return tf.AlbertForSequenceClassification(config), _tokens()


def electra():
    config = tf.ElectraConfig(vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=128, num_labels=4)
    return tf.ElectraForSequenceClassification(config), _tokens()


def resnet():
    config = tf.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                             layer_type="basic", num_labels=4)
    return tf.ResNetForImageClassification(config), _pixels()


def vit():
    config = tf.ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=128, num_labels=4)
    return tf.ViTForImageClassification(config), _pixels()


ENCODERS = {f.__name__: f for f in (convnext, swin, segformer, mobilevit, albert, electra, resnet, vit)}
