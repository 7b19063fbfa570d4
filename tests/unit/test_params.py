"""Request parameters, strictly typed and to the letter: a boolean is not a number, numbers
are finite, text from a query or a form is parsed; the 422 a client gets names the field and
the rule broken, in the same words whatever the source; a field given twice is refused; and
the OpenAPI pieces built from the same models."""

from __future__ import annotations

import enum

import pytest
from pydantic import Field, model_validator

from services.runtime.codecs.params import (
    Bool,
    Float,
    Int,
    Params,
    Str,
    Text,
    inline_schema,
    merge,
    query_parameters,
    validate,
)
from services.runtime.errors import ApiError


class P(Params):
    f: Float = 0.5
    i: Int = 1
    b: Bool = False
    s: Str = ""
    many: list[Int] = []


@pytest.mark.parametrize("data", [{"f": True}, {"i": False}, {"f": "0.5"}, {"i": 1.5}, {"b": 1}, {"s": 5},
                                  {"f": float("nan")}, {"f": float("inf")}, {"zz": 1}])
def test_typed_values_are_strict(data):
    with pytest.raises(ApiError) as err:
        validate(P, data)
    assert err.value.status == 422


def test_integral_floats_are_integers_and_ints_are_floats():
    p = validate(P, {"i": 20.0, "f": 3})
    assert p.i == 20 and isinstance(p.i, int) and p.f == 3.0


def test_text_values_from_a_query_are_parsed_but_stay_finite():
    p = validate(P, merge({"f": "0.25", "i": "7", "b": "true", "s": "x"}, {}))
    assert (p.f, p.i, p.b, p.s) == (0.25, 7, True, "x")
    for bad in ({"f": "nan"}, {"f": "1e999"}, {"i": "1.5"}, {"b": "maybe"}, {"i": "abc"}):
        with pytest.raises(ApiError):
            validate(P, merge(bad, {}))
    with pytest.raises(ApiError) as err:
        merge({"f": "1"}, {"f": 1})
    assert "both" in err.value.message


def error_of(data) -> ApiError:
    with pytest.raises(ApiError) as err:
        validate(P, data)
    assert (err.value.status, err.value.code) == (422, "invalid_parameter")
    return err.value


@pytest.mark.parametrize("data,message", [
    ({"f": True}, "f: expected a number, got a boolean"),
    ({"f": "0.5"}, "f: expected a number, got a string"),         # text in JSON is not a number
    ({"f": Text("0.5x")}, "f: expected a number, got '0.5x'"),
    ({"f": Text("9" * 50 + "x")}, "f: expected a number, got '" + "9" * 40 + "'"),
    ({"f": float("nan")}, "f: expected a finite number"),
    ({"f": Text("-inf")}, "f: expected a finite number"),
    ({"f": [1]}, "f: expected a number"),
    ({"i": 1.5}, "i: expected a whole number"),
    ({"b": 1}, "b: expected true or false"),
    ({"b": Text("maybe")}, "b: expected true or false"),
    ({"s": 5}, "s: expected a string"),
    ({"many": [1, 2.5]}, "many.1: expected a whole number"),
])
def test_each_rule_has_its_own_message_naming_the_field(data, message):
    assert error_of(data).message == message


def test_several_faults_are_listed_in_order_up_to_five():
    data = {"f": True, "i": 1.5, "b": 2, "s": 3, "many": [0.5], "zz": 1}
    assert error_of(data).message == ("f: expected a number, got a boolean; i: expected a whole number; "
                                      "b: expected true or false; s: expected a string; "
                                      "many.0: expected a whole number")


def test_a_fault_of_the_whole_body_is_reported_as_body():
    class Pair(Params):
        lo: Int = 0
        hi: Int = 1

        @model_validator(mode="after")
        def _ordered(self):
            if self.lo > self.hi:
                raise ValueError("lo must not be above hi")
            return self

    with pytest.raises(ApiError) as err:
        validate(Pair, {"lo": 5, "hi": 2})
    assert err.value.message == "body: lo must not be above hi"


@pytest.mark.parametrize("text,value", [("true", True), ("1", True), ("yes", True), ("on", True), (" YES ", True),
                                        ("On", True), ("false", False), ("0", False), ("no", False), ("off", False),
                                        ("FALSE", False), (" Off ", False), ("No", False)])
def test_booleans_from_text(text, value):
    assert validate(P, {"b": Text(text)}).b is value


def test_whole_numbers_from_text_are_exact_and_signed():
    big = 2**53 + 1  # not representable as a float
    assert validate(P, {"i": Text(str(big))}).i == big
    assert validate(P, {"i": Text(f"-{big}")}).i == -big
    assert validate(P, {"i": Text(f"+{big}")}).i == big
    assert validate(P, {"i": Text("20.0")}).i == 20


def test_merge_refuses_a_field_given_twice_and_marks_query_values_as_text():
    with pytest.raises(ApiError) as err:
        merge({"z": "1", "b": "2", "a": "3"}, {"b": 1, "a": 2})
    assert (err.value.status, err.value.code) == (422, "invalid_parameter")
    assert err.value.message == "a: given both in the query string and in the body"
    merged = merge({"f": "0.5"}, {"i": 3})
    assert merged == {"f": "0.5", "i": 3} and type(merged["f"]) is Text


# ---- OpenAPI ---------------------------------------------------------------------------------
class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Inner(Params):
    level: Int = 1


class Documented(Params):
    color: Color = Field(..., description="which color")
    inner: Inner = Inner()
    options: list[Inner] = []
    plain: Float = 0.5


def test_inline_schema_has_no_references_left_and_keeps_what_was_beside_them():
    schema = inline_schema(Documented)
    text = repr(schema)
    assert "$ref" not in text and "$defs" not in text
    props = schema["properties"]
    assert props["color"]["enum"] == ["red", "blue"] and props["color"]["description"] == "which color"
    assert props["inner"]["properties"]["level"]["type"] == "integer" and props["inner"]["default"] == {"level": 1}
    assert props["options"]["items"]["properties"]["level"]["type"] == "integer"
    assert schema["required"] == ["color"]


def test_inline_schema_is_the_validation_schema_unless_asked_otherwise():
    from decimal import Decimal

    class Amount(Params):
        value: Decimal = Decimal(1)

    # validation accepts a number or a string; serialization always writes a string
    assert "anyOf" in inline_schema(Amount)["properties"]["value"]
    assert inline_schema(Amount, mode="serialization")["properties"]["value"]["type"] == "string"


def test_query_parameters_one_per_field_with_required_and_description():
    params = {p["name"]: p for p in query_parameters(Documented)}
    assert list(params) == ["color", "inner", "options", "plain"]
    color, plain = params["color"], params["plain"]
    assert (color["in"], color["required"], color["description"]) == ("query", True, "which color")
    assert color["schema"]["enum"] == ["red", "blue"]
    assert (plain["in"], plain["required"]) == ("query", False) and "description" not in plain
    assert plain["schema"]["type"] == "number"
    assert set(color) == {"name", "in", "required", "schema", "description"}
    assert set(plain) == {"name", "in", "required", "schema"}


def test_a_model_without_fields_has_no_query_parameters():
    class Empty(Params):
        pass

    assert query_parameters(Empty) == []


def test_a_long_unknown_key_is_named_short_in_the_422():
    class Model(Params):
        steps: int = 1
    with pytest.raises(ApiError) as err:
        validate(Model, {"k" * 5_000_000: 1, "z" * 5_000_000: 2})
    assert err.value.status == 422 and len(err.value.message) < 400 and "kkk" in err.value.message
